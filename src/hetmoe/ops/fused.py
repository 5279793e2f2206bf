"""The decoder layer's math as pure functions of tensors (weights are arguments, no modules).

Both paths call them: the module path (ops/decoder_layer.py, ops/norm.py, ops/attention.py,
ops/mla.py, ops/moe_step.py: `rms_norm`, `residual`, `sum_terms`, `absorbed_weights`, rope
through ops/rope.py) and the fused decode step (engine/executor/fused_decode.py), whose other
functions here are decode's own forms: one decode step of a decoder layer is a chain of small
operations; launched one by one they cost ~70 GPU kernels per layer at batch 1. Written as pure
functions, `torch.compile` (Inductor) fuses them into a few kernels, and since the weights are
arguments, every layer of a model shares one compiled graph. Eagerly they are the same math,
which the CPU tests compare with the module path.

Shapes: B rows (sequences), one new token each; H hidden, h query heads, h_kv key/value heads,
D head dim, K experts per token; N cache slots, C cache length; the attended window (the
runner's window bucket, ops/kv_batch.py `window_bucket`) as n chunks of c = WINDOW_CHUNK.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hetmoe.ops.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, rounded to x's dtype, then scaled by `weight`."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def sum_terms(terms: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """An MLP's output from its terms (routed experts, the previous MoE layer's deferred ones,
    shared experts), each rounded to `dtype` first, summed in order."""
    out = terms[0].to(dtype)
    for t in terms[1:]:
        out = out + t.to(dtype)
    return out


def residual(h: torch.Tensor, terms: Sequence[torch.Tensor]) -> torch.Tensor:
    """h + the MLP's terms (`sum_terms` in h's dtype): the residual add after a decoder layer's
    MLP, on both paths (the module path's terms are in h's dtype already, the fused step's
    routed output is fp32)."""
    if not terms:
        return h
    return h + sum_terms(terms, h.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, named for the layer plans."""
    return F.linear(x, weight, bias)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotation of interleaved pairs (x[2i], x[2i+1]) by angle i, as DeepSeek-V2's complex
    `freqs_cis` does (cos/sin = its real/imaginary parts [B, 1, D/2]); x [B, heads, 1, D]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # [..., D/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D/2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2) \
        .type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """Rope on x [B, heads, 1, D]: mode `half` (rotate-half), `interleave` (DeepSeek-V3's
    de-interleaving form) or `pairs` (DeepSeek-V2's complex form, see `rope_pairs`)."""
    if mode == "pairs":
        return rope_pairs(x, cos, sin)
    return apply_rope(x, (cos, sin), interleave=mode == "interleave")


WINDOW_CHUNK = 64
"""Cache entries per chunk of the attended window (a static size: reductions over a chunk are
parallel over the chunks, whose number is the compiled graph's one dynamic dimension)."""


def window_mask(pos: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[B, n, WINDOW_CHUNK] bool: True for the cached entries before each row's position (and
    within its sliding window), over the first `width` entries in n >= 2 chunks (padded with
    False; at least two chunks so a compiler never specializes a chunk count of 1)."""
    n = max(2, -(-width // WINDOW_CHUNK))
    keys = torch.arange(n * WINDOW_CHUNK, device=pos.device).view(n, WINDOW_CHUNK)
    allowed = keys[None] < pos[:, None, None]  # [B, n, c]
    if window is not None:
        allowed &= pos[:, None, None] - keys[None] < window
    return allowed


def window_bounds(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B] the first cached entry each row attends (kernels/gqa_decode.py's `lo`; `window_mask`
    as bounds): 0, or with a sliding window of `window` entries, which hold the row's own entry
    and the `window` - 1 before it, pos - window + 1 (at least 0)."""
    if window is None:
        return torch.zeros_like(pos)
    return (pos - window + 1).clamp(min=0)


def window_rows(cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's cache slot over the window of `mask` [B, n, c]: cache [N, C, ...] ->
    [B, n, c, ...]. Entries past C (padding, masked) read the last entry instead.

    Indexed by (slot, key) pairs, not sliced: a compiler keeps the window symbolic this way; a
    slice [:, :width] makes it specialize a width equal to C into a graph of its own."""
    n, c = mask.shape[1:]
    keys = torch.arange(n * c, device=slots.device).clamp(max=cache.shape[1] - 1)
    return cache[slots[:, None, None], keys.view(1, n, c)]


def chunked_softmax(scores: torch.Tensor, own: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the cached entries (scores [..., n, c] fp32, `mask` broadcast to them, False
    entries weigh 0) and the row's own entry (own [..., 1]) -> (probs [..., n, c], own [..., 1]).
    The softmax's math (max, exp, sum, divide) with its max and sum taken per chunk, then over
    the chunks: the same values up to the summation order."""
    scores = scores.masked_fill(~mask, float("-inf"))
    top = torch.maximum(scores.amax(-1).amax(-1, keepdim=True), own)  # [..., 1], finite
    exps = torch.exp(scores - top[..., None])
    own_exp = torch.exp(own - top)
    total = exps.sum(-1).sum(-1, keepdim=True) + own_exp  # [..., 1]
    return exps / total[..., None], own_exp / total


def gqa_decode_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per row over its cached keys plus its own new key (not yet in the cache).

    q [B, h, D], k_new / v_new [B, h_kv, D], caches [N, C, h_kv, D], slots [B], mask [B, n, c]
    (`window_mask`: True for a cached entry before the row's position) -> [B, h*D]. Query heads
    are grouped per key head (no repeated keys). Both products are written as product-sums over
    gathered rows, which a compiler turns into reduction kernels (gather included), per chunk
    of the window and then over the chunks; bf16 products are exact in fp32, so this is the
    matmul's math; probabilities are rounded to q's dtype before the second product, as the
    module path's matmul does."""
    b, h, d = q.shape
    kv_heads = k_new.shape[1]
    qg = q.view(b, kv_heads, h // kv_heads, 1, 1, d).float()  # [B, h_kv, g, 1, 1, D]
    keys = window_rows(k_cache, slots, mask).permute(0, 3, 1, 2, 4)[:, :, None].float()
    values = window_rows(v_cache, slots, mask).permute(0, 3, 1, 2, 4)[:, :, None].float()
    scores = (qg * keys).sum(-1) * scale  # [B, h_kv, g, n, c]
    own = (qg[:, :, :, 0, 0] * k_new[:, :, None].float()).sum(-1, keepdim=True) * scale
    probs, own_prob = chunked_softmax(scores, own, mask[:, None, None])
    probs, own_prob = probs.to(q.dtype).float(), own_prob.to(q.dtype).float()
    out = (probs[..., None] * values).sum(-2).sum(-2)  # [B, h_kv, g, D]
    out = out + own_prob * v_new[:, :, None].float()
    return out.to(q.dtype).reshape(b, h * d)


def absorbed_weights(kv_b_weight: torch.Tensor, heads: int, nope: int, v_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's kv_b_proj weight [h*(nope+v), r] as the two halves decode folds into the query and
    the output (views): w_k [h, nope, r], w_v [h, v, r]."""
    weight = kv_b_weight.view(heads, nope + v_dim, kv_b_weight.shape[-1])
    w_k, w_v = weight.split([nope, v_dim], dim=1)
    return w_k, w_v


def mla_decode_attention(
    q_latent: torch.Tensor, q_rot: torch.Tensor, latent_new: torch.Tensor,
    k_rot_new: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
    slots: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """MLA decode in latent space over the cache plus the row's own new entry (product-sums
    per chunk, as in `gqa_decode_attention`).

    q_latent [B, h, r], q_rot [B, h, d], latent_new [B, r], k_rot_new [B, d], latent_cache
    [N, C, r], rope_cache [N, C, d], mask [B, n, c] -> latent output [B, h, r]."""
    dtype = latent_cache.dtype
    latent = window_rows(latent_cache, slots, mask)[:, None].float()  # [B, 1, n, c, r]
    k_rot = window_rows(rope_cache, slots, mask)[:, None].float()  # [B, 1, n, c, d]
    ql, qr = q_latent.float(), q_rot.float()  # [B, h, *]
    scores = ((ql[:, :, None, None] * latent).sum(-1)
              + (qr[:, :, None, None] * k_rot).sum(-1)) * scale  # [B, h, n, c]
    own = ((ql * latent_new[:, None].float()).sum(-1, keepdim=True)
           + (qr * k_rot_new[:, None].float()).sum(-1, keepdim=True)) * scale  # [B, h, 1]
    probs, own_prob = chunked_softmax(scores, own, mask[:, None])
    probs, own_prob = probs.to(dtype).float(), own_prob.to(dtype).float()
    out = (probs[..., None] * latent).sum(-2).sum(-2)  # [B, h, r]
    out = out + own_prob * latent_new[:, None].float()
    return out.to(dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """The gated MLP of every supported family: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def pack_moe_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One int32 staging vector [T*(H + 3K)] = x (fp32 bits) | ids (int64 as int32 pairs) |
    weights (fp32 bits).

    So one copy moves a layer's CPU-expert inputs; engine/executor/host_link.py views the same bytes
    as x [T, H] float32, ids [T, K] int64 and weights [T, K] float32 (little-endian: an int64 id is
    its low int32 word, then the sign word). Integers, not floats, carry the bits: a float copy
    may rewrite the NaN patterns that small negative ids make."""
    low = ids.to(torch.int32)
    pairs = torch.stack((low, low >> 31), dim=-1)  # [T, K, 2]
    return torch.cat((x.float().view(torch.int32).flatten(), pairs.flatten(),
                      weights.float().view(torch.int32).flatten()))


def unpack_moe_inputs(stage: torch.Tensor, rows: int, hidden: int,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a `pack_moe_inputs` vector: x [T, H] fp32, ids [T, K] int64, weights [T, K]."""
    n_x, n_ids = rows * hidden, 2 * rows * top_k
    x = stage[:n_x].view(torch.float32).view(rows, hidden)
    ids = stage[n_x:n_x + n_ids].view(torch.int64).view(rows, top_k)
    weights = stage[n_x + n_ids:n_x + n_ids + rows * top_k].view(torch.float32)
    return x, ids, weights.view(rows, top_k)


def staged_words(rows: int, hidden: int, top_k: int) -> int:
    """Length of a `pack_moe_inputs` vector for `rows` tokens (rows * hidden must be even, so
    the ids start on an 8-byte boundary)."""
    return rows * (hidden + 3 * top_k)
