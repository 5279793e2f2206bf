"""Decode-step math as pure functions of tensors (weights are arguments, no modules).

One decode step of a decoder layer is a chain of small operations; launched one by one they cost
~70 GPU kernels per layer at batch 1. Written as pure functions, `torch.compile` (Inductor) fuses
them into a few kernels, and since the weights are arguments, every layer of a model shares one
compiled graph (engine/fused_decode.py). Eagerly they are the same math, which the CPU tests
compare with the module path (HF layers + ops/attention.py, ops/mla.py).

Shapes: B rows (sequences), one new token each; H hidden, h query heads, h_kv key/value heads,
D head dim, L cache window, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetmoe.ops.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, rounded to x's dtype, then scaled by `weight`."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


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


def masked_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """scores [B, a, b, L] fp32 with cache entries a row may not see set to -inf (mask [B, L])."""
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


def gqa_decode_attention(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per row over its cached keys plus its own new key (not yet in the cache).

    q [B, h, D], k_new / v_new [B, h_kv, D], caches [N, L, h_kv, D], slots [B], mask [B, L]
    (True: a cached entry before the row's position) -> [B, h*D]. Query heads are grouped per
    key head (no repeated keys). Both products are written as product-sums over gathered rows,
    which a compiler turns into one reduction kernel each (gather included); bf16 products are
    exact in fp32, so this is the matmul's math; probabilities are rounded to q's dtype before
    the second product, as the module path's matmul does."""
    b, h, d = q.shape
    kv_heads = k_new.shape[1]
    qg = q.view(b, kv_heads, h // kv_heads, 1, d).float()  # [B, h_kv, g, 1, D]
    keys = k_cache[slots].transpose(1, 2)[:, :, None].float()  # [B, h_kv, 1, L, D]
    values = v_cache[slots].transpose(1, 2)[:, :, None].float()
    scores = (qg * keys).sum(-1) * scale  # [B, h_kv, g, L]
    own = (qg[:, :, :, 0] * k_new[:, :, None].float()).sum(-1, keepdim=True) * scale
    probs = torch.cat((masked_scores(scores, mask), own), dim=-1).softmax(dim=-1)
    probs = probs.to(q.dtype).float()
    out = (probs[..., :-1, None] * values).sum(-2)  # [B, h_kv, g, D]
    out = out + probs[..., -1:] * v_new[:, :, None].float()
    return out.to(q.dtype).reshape(b, h * d)


def mla_decode_attention(
    q_latent: torch.Tensor, q_rot: torch.Tensor, latent_new: torch.Tensor,
    k_rot_new: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
    slots: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """MLA decode in latent space over the cache plus the row's own new entry (product-sums,
    as in `gqa_decode_attention`).

    q_latent [B, h, r], q_rot [B, h, d], latent_new [B, r], k_rot_new [B, d], latent_cache
    [N, L, r], rope_cache [N, L, d], mask [B, L] -> latent output [B, h, r]."""
    dtype = latent_cache.dtype
    latent = latent_cache[slots][:, None].float()  # [B, 1, L, r]
    k_rot = rope_cache[slots][:, None].float()  # [B, 1, L, d]
    ql, qr = q_latent.float()[:, :, None], q_rot.float()[:, :, None]  # [B, h, 1, *]
    scores = ((ql * latent).sum(-1) + (qr * k_rot).sum(-1)) * scale  # [B, h, L]
    own = ((ql[:, :, 0] * latent_new[:, None].float()).sum(-1, keepdim=True)
           + (qr[:, :, 0] * k_rot_new[:, None].float()).sum(-1, keepdim=True)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.cat((scores, own), dim=-1).softmax(dim=-1).to(dtype).float()  # [B, h, L+1]
    out = (probs[..., :-1, None] * latent).sum(-2)  # [B, h, r]
    out = out + probs[..., -1:] * latent_new[:, None].float()
    return out.to(dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """The gated MLP of every supported family: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def pack_moe_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One int32 staging vector [T*(H + 3K)] = x (fp32 bits) | ids (int64 as int32 pairs) |
    weights (fp32 bits).

    So one copy moves a layer's CPU-expert inputs; engine/host_link.py views the same bytes as
    x [T, H] float32, ids [T, K] int64 and weights [T, K] float32 (little-endian: an int64 id is
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
