"""GQA decode attention (flash-decoding) on the runner's KV cache, with the step's cache write.

One query per row (sequence) over the row's cached entries plus its own new entry, which the
kernel also stores at the row's position; optionally q and k as projected, RMSNormed per head
and rotated (rotate-half rope) on the way in. The math of `ops/fused.py` (`rms_norm`,
`rotate`, `gqa_decode_attention`: the torch ops, which the compiled decode step otherwise
spreads over ~10 Inductor kernels and an index_put per layer) in two kernels:

- `split_kernel`, one program per (row, key head, split of the row's window): all query heads
  of the key head's group at once (q [G, D] against keys [64, D] as one dot), an online
  softmax over the split's entries; split 0 also takes the own entry and writes the cache.
  Probabilities are rounded to q's dtype before the value product (relative to the running
  maximum, as flash attention rounds them; the torch form rounds them normalized: the same
  rounding error, not the same bits). Writes each split's (max, sum, unnormalized output).
- `combine_kernel`, one program per (row, query head): the splits' outputs rescaled to the
  common maximum and divided by the common sum.

The split count follows the attended window (the runner's bucket, in chunks of 64 entries)
with no branch on it, so a compiled decode step keeps the window's chunk count dynamic.
`gqa_decode_attention` is a torch custom op: a compiled step calls it from its graph (Inductor
fuses the ops around it; it launches both kernels itself, as programmatic dependents where
kernels/pdl.py says so).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hetmoe.kernels.dequant import INTERPRETED, rms_scale, to_dtype
from hetmoe.kernels.pdl import launch_args, start_next, wait_prior

BLOCK_N = tl.constexpr(64)
"""Cache entries per inner step (the fused step's window chunk, ops/fused.py)."""
CHUNKS_PER_SPLIT = 2
"""Window chunks of 64 entries per split program: the split count is the window's chunk count
over this (a window of 256 entries: 2 splits; 32K: 256)."""


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: fp32 inputs (fp32 models, or the interpreter, which
    multiplies 16-bit operands as raw bits) in full precision, 16-bit inputs on tensor cores
    (their products are exact in fp32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _heads(base, rows, live_rows, w_ptr, cos, sin, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
           NORM: tl.constexpr, ROPE: tl.constexpr, dtype: tl.constexpr):
    """Head vectors `rows` [R] at base + row * D -> [R, BLOCK_D] in `dtype`: as projected, or
    RMSNormed with the weights at w_ptr [D] (fp32 statistics, rounded to dtype, times the
    weight, rounded: ops/fused.py `rms_norm`), then rotated by cos / sin [BLOCK_D] fp32
    (rotate-half rope: x cos + rotate_half(x) sin, rounded once)."""
    d = tl.arange(0, BLOCK_D)
    at = live_rows[:, None] & (d < D)[None, :]
    x = tl.load(base + rows[:, None] * D + d[None, :], mask=at, other=0.0).to(tl.float32)
    partner = (d + D // 2) % D  # rotate_half's source of each element
    xr = x
    if ROPE:
        xr = tl.load(base + rows[:, None] * D + partner[None, :], mask=at, other=0.0)
        xr = xr.to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x * x, 1) / D + eps).to(tl.float32))[:, None]  # [R, 1]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        x = rms_scale(x, inv, w[None, :], dtype)
        if ROPE:
            w = tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
            xr = rms_scale(xr, inv, w[None, :], dtype)
    if ROPE:
        sign = tl.where(d < D // 2, -1.0, 1.0)
        x = x * cos[None, :] + sign[None, :] * xr * sin[None, :]
    return to_dtype(x, dtype)


@triton.jit
def split_kernel(q_ptr, k_new_ptr, v_new_ptr, cache_ptr, slots_ptr, lo_ptr, pos_ptr, part_ptr,
                 stat_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, s_q, s_k, s_v, s_cos,
                 s_slot, s_key, s_kv, s_head, scale, eps, H_KV: tl.constexpr, G: tl.constexpr,
                 D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 NORM: tl.constexpr, ROPE: tl.constexpr, IEEE: tl.constexpr,
                 PDL: tl.constexpr):
    """q [B, H_KV*G, D], k_new / v_new [B, H_KV, D] (rows s_q / s_k / s_v apart, heads D);
    NORM: q / k RMSNorms (weights [D]), ROPE: cos / sin [B, D] (rows s_cos apart) applied to
    them here; cache [N, C, 2, H_KV, D] by strides; part [B, H_KV*G, S, D] fp32 and stat
    [B, H_KV*G, S, 2] fp32 (max, sum) written. Row b attends its cached entries
    [lo[b], pos[b]) and its own. Products with the float arguments scale and eps are cast to
    fp32 (Inductor passed Python floats as fp64 scalars when it launched this kernel). PDL: launched
    as a programmatic dependent (kernels/pdl.py)."""
    wait_prior(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    dtype = q_ptr.dtype.element_ty
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    live_g, live_d = g < G, d < D
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slots_ptr + b)
    cos = tl.zeros([BLOCK_D], dtype=tl.float32)
    sin = cos
    if ROPE:
        cos = tl.load(cos_ptr + b * s_cos + d, mask=live_d, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * s_cos + d, mask=live_d, other=0.0).to(tl.float32)
    head = kvh * G + g  # [BLOCK_G] query heads of this key head
    q = _heads(q_ptr + b * s_q, head, live_g, q_norm_ptr, cos, sin, eps, D, BLOCK_D, NORM, ROPE,
               dtype)  # [BLOCK_G, BLOCK_D]
    row = cache_ptr + slot * s_slot + kvh * s_head  # this row's slot, this key head
    lo = tl.load(lo_ptr + b)
    per = tl.cdiv(tl.cdiv(pos - lo, splits), BLOCK_N) * BLOCK_N  # entries per split
    start = lo + split * per
    end = tl.minimum(start + per, pos)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if split == 0:  # the own entry: stored, and the softmax's first term
        one = kvh + tl.zeros([1], tl.int32)
        k_own = _heads(k_new_ptr + b * s_k, one, one >= 0, k_norm_ptr, cos, sin, eps, D,
                       BLOCK_D, NORM, ROPE, dtype)  # [1, BLOCK_D]
        v_own = tl.load(v_new_ptr + b * s_v + kvh * D + d[None, :], mask=live_d[None, :],
                        other=0.0)
        own = row + pos * s_key + d[None, :]
        tl.store(own, k_own.to(cache_ptr.dtype.element_ty), mask=live_d[None, :])
        tl.store(own + s_kv, v_own.to(cache_ptr.dtype.element_ty), mask=live_d[None, :])
        m = (tl.sum(q.to(tl.float32) * k_own.to(tl.float32), 1) * scale).to(tl.float32)
        total += 1.0
        acc += v_own.to(tl.float32)
    n = tl.arange(0, BLOCK_N)
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + n
        live_n = keys < end
        at = row + keys.to(tl.int64)[:, None] * s_key + d[None, :]  # [BLOCK_N, BLOCK_D]
        cached = live_n[:, None] & live_d[None, :]
        k = tl.load(at, mask=cached, other=0.0)
        scores = (_dot(q, tl.trans(k), IEEE) * scale).to(tl.float32)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(live_n[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, 1))  # finite: one live entry per step
        alpha = tl.exp(m - top)
        p = tl.exp(scores - top[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(at + s_kv, mask=cached, other=0.0)
        acc = acc * alpha[:, None] + _dot(to_dtype(p, dtype), v, IEEE)
        m = top
    start_next(PDL)
    part = (b * H_KV * G + head)[:, None] * splits + split  # [BLOCK_G, 1]
    tl.store(part_ptr + part * D + d[None, :], acc, mask=live_g[:, None] & live_d[None, :])
    stat = stat_ptr + (b * H_KV * G + head) * splits * 2 + split * 2
    tl.store(stat, m, mask=live_g)
    tl.store(stat + 1, total, mask=live_g)


@triton.jit(do_not_specialize=["splits"])  # a compiled step keeps the split count dynamic
def combine_kernel(part_ptr, stat_ptr, out_ptr, splits, D: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """part [B, h, S, D] and stat [B, h, S, 2] of `split_kernel` -> out [B, h, D] (out's
    dtype). An empty split (max -inf, sum 0) weighs 0; split 0 always holds the own entry.
    PDL: kernels/pdl.py."""
    wait_prior(PDL)
    bh = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    live_d = d < D
    stat = stat_ptr + bh * splits * 2
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        top = tl.maximum(top, tl.load(stat + (s0 + s) * 2, mask=s0 + s < splits,
                                      other=float("-inf")))
    m = tl.max(top, 0)  # finite (split 0)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        live_s = s0 + s < splits
        weight = tl.exp(tl.load(stat + (s0 + s) * 2, mask=live_s, other=float("-inf")) - m)
        total += weight * tl.load(stat + (s0 + s) * 2 + 1, mask=live_s, other=0.0)
        at = part_ptr + (bh * splits + s0 + s)[:, None] * D + d[None, :]
        acc += weight[:, None] * tl.load(at, mask=live_s[:, None] & live_d[None, :], other=0.0)
    out = tl.sum(acc, 0) / tl.sum(total, 0)
    out = to_dtype(out, out_ptr.dtype.element_ty)
    tl.store(out_ptr + bh * D + d, out, mask=live_d)


def check_inputs(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 kv_cache: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor,
                 pos: torch.Tensor) -> None:
    """ValueError naming the first argument whose shape, dtype or layout does not fit."""
    if q.dim() != 3 or k_new.dim() != 3:
        raise ValueError(f"gqa_decode_attention: q [B, h, D] and k_new [B, h_kv, D] expected, "
                         f"got {tuple(q.shape)} and {tuple(k_new.shape)}")
    b, h, d = q.shape
    kv_heads = k_new.shape[1]
    if k_new.shape != (b, kv_heads, d) or v_new.shape != k_new.shape or h % kv_heads:
        raise ValueError(f"gqa_decode_attention: k_new / v_new {tuple(k_new.shape)} / "
                         f"{tuple(v_new.shape)} do not fit q {tuple(q.shape)} (h a multiple "
                         "of h_kv)")
    if kv_cache.dim() != 5 or kv_cache.shape[2:] != (2, kv_heads, d) or kv_cache.stride(-1) != 1:
        raise ValueError(f"gqa_decode_attention: kv_cache [N, C, 2, {kv_heads}, {d}] with unit "
                         f"stride last expected, got {tuple(kv_cache.shape)}")
    if slots.shape != (b,) or lo.shape != (b,) or pos.shape != (b,):
        raise ValueError(f"gqa_decode_attention: slots, lo and pos [{b}] expected, got "
                         f"{tuple(slots.shape)}, {tuple(lo.shape)} and {tuple(pos.shape)}")
    if not q.dtype == k_new.dtype == v_new.dtype == kv_cache.dtype:
        raise ValueError(f"gqa_decode_attention: q, k_new, v_new and kv_cache share one dtype, "
                         f"got {q.dtype}, {k_new.dtype}, {v_new.dtype}, {kv_cache.dtype}")


def check_prologue(q: torch.Tensor, norms: tuple[torch.Tensor | None, ...],
                   rope: tuple[torch.Tensor | None, ...]) -> None:
    """ValueError unless q/k norms and cos/sin are both given or both absent, with [D]
    weights and [B, D] (or [B, 1, D]) angles; rope needs an even D."""
    b, _, d = q.shape
    for pair, name, shape in ((norms, "q_norm / k_norm", (d,)), (rope, "cos / sin", (b, d))):
        given = [t is not None for t in pair]
        if any(given) and not all(given):
            raise ValueError(f"gqa_decode_attention: {name} are given together, got one")
        if all(given) and any(t.numel() != math.prod(shape) or t.shape[0] != shape[0]
                              for t in pair if t is not None):
            raise ValueError(f"gqa_decode_attention: {name} of {list(shape)} expected, got "
                             f"{[tuple(t.shape) for t in pair if t is not None]}")
    if rope[0] is not None and d % 2:
        raise ValueError(f"gqa_decode_attention: rope needs an even head dim, got {d}")


def _heads_layout(x: torch.Tensor) -> torch.Tensor:
    """x [B, heads, D] with unit element and D head strides (rows may be apart, as q, k and v
    are in the fused projection's output), else a contiguous copy."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


@torch.library.custom_op("hetmoe::gqa_decode_attention", mutates_args=("kv_cache",))
def gqa_decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         kv_cache: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor,
                         pos: torch.Tensor, num_chunks: int, scale: float,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                         eps: float = 0.0, cos: torch.Tensor | None = None,
                         sin: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, h, D] over row b's cached entries [lo[b], pos[b]) of slot
    `slots[b]` plus its own k_new / v_new [B, h_kv, D], which are stored at cache[slot, pos]
    -> [B, h, D] in q's dtype. kv_cache [N, C, 2, h_kv, D] (keys, values); lo: 0 attends every
    cached entry, pos - window + 1 a sliding window (ops/fused.py `window_bounds`);
    `num_chunks`: the attended window in chunks of 64 (sets the splits); 0 <= lo <= pos < C
    (not checked: no host sync). With q_norm / k_norm [D] (eps) and cos / sin [B, D], q and
    k_new are as projected: RMSNormed per head and rotated (rotate-half) here first."""
    check_inputs(q, k_new, v_new, kv_cache, slots, lo, pos)
    check_prologue(q, (q_norm, k_norm), (cos, sin))
    b, h, d = q.shape
    kv_heads = k_new.shape[1]
    norm, rope = q_norm is not None, cos is not None
    q, k_new, v_new = _heads_layout(q), _heads_layout(k_new), _heads_layout(v_new)
    # q stands in for absent tensors (NORM / ROPE off: the kernel never reads them)
    q_norm, k_norm = q_norm if q_norm is not None else q, k_norm if k_norm is not None else q
    cos = cos.reshape(b, d).contiguous() if cos is not None else q
    sin = sin.reshape(b, d).contiguous() if sin is not None else q
    splits = (num_chunks + CHUNKS_PER_SPLIT - 1) // CHUNKS_PER_SPLIT
    # part [B, h, S, D] and stat [B, h, S, 2], flat (the kernels index them by hand)
    part = q.new_empty((b * h * splits * d,), dtype=torch.float32)
    stat = q.new_empty((b * h * splits * 2,), dtype=torch.float32)
    out = q.new_empty((b, h, d))
    block_d = max(16, triton.next_power_of_2(d))
    pdl = launch_args(q.device)
    split_kernel[(b, kv_heads, splits)](
        q, k_new, v_new, kv_cache, slots.contiguous(), lo.contiguous(), pos.contiguous(), part,
        stat, q_norm, k_norm, cos, sin,
        q.stride(0), k_new.stride(0), v_new.stride(0), cos.stride(0), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), scale, eps, H_KV=kv_heads,
        G=h // kv_heads, D=d, BLOCK_G=max(16, triton.next_power_of_2(h // kv_heads)),
        BLOCK_D=block_d, NORM=norm, ROPE=rope,
        IEEE=q.dtype == torch.float32 or bool(INTERPRETED), **pdl)
    combine_kernel[(b * h,)](part, stat, out, splits, D=d, BLOCK_S=16, BLOCK_D=block_d, **pdl)
    return out


@gqa_decode_attention.register_fake
def _(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
      slots: torch.Tensor, lo: torch.Tensor, pos: torch.Tensor, num_chunks: int, scale: float,
      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
      cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty(q.shape)
