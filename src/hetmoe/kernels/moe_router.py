"""The decode step's MoE layer entry after attention, in two kernels: residual, norm, router.

From o_proj's output to the packed inputs of the layer's experts (engine/executor/fused_decode.py's
layer tail), which Inductor otherwise spreads over ~5 kernels per layer:

    h += o -> x = RMSNorm(h) -> logits = router x -> softmax / sigmoid -> top-k -> weights
    -> stage = x (fp32 bits) | ids (int32 pairs) | weights (fp32 bits)   (ops/fused.py pack)

- `logits_kernel`, one program per (row, block of experts): the residual add and the norm of
  the row (recomputed by each program: H values), the block's logits; the first block's program
  also stores h, x and x's part of the stage.
- `topk_kernel`, one program per row: the scores, K argmax passes (lowest id on ties, as
  ops/router.py `top_k_ids`), the weights as the router's config says, its part of the stage.

Routers whose choice no expert group limits (ops/router.py `RouterConfig.kernel_fits`): greedy
ones and `noaux_tc` ones with one group, whose bias steers the choice while the weights are the
unbiased scores; group-limited ones keep the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from hetmoe.kernels.dequant import rms_scale, to_dtype


@triton.jit
def _residual(h_ptr, o_ptr, b, H, i0, i, live, dtype: tl.constexpr):
    """Row b's h + o at columns i0 + i (where `live`, 0 elsewhere) in fp32, rounded to `dtype` as
    h_out holds it: both passes of `logits_kernel` read the same values."""
    v = tl.load(h_ptr + b * H + i0 + i, mask=live, other=0.0).to(tl.float32)
    v += tl.load(o_ptr + b * H + i0 + i, mask=live, other=0.0).to(tl.float32)
    return to_dtype(v, dtype).to(tl.float32)


@triton.jit
def logits_kernel(h_ptr, o_ptr, norm_ptr, router_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, H, E, eps, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  LOGITS_FP32: tl.constexpr):
    """h, o [B, H] -> h_out = h + o, x_out = RMSNorm(h_out) (h's dtype), stage[b H + i] = x
    as fp32 bits, logits [B, E] fp32 (rounded to h's dtype unless LOGITS_FP32)."""
    b = tl.program_id(0)
    block = tl.program_id(1)
    dtype = h_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_H)
    e = block * BLOCK_E + tl.arange(0, BLOCK_E)
    squares = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i0 in range(0, H, BLOCK_H):
        live = i0 + i < H
        v = _residual(h_ptr, o_ptr, b, H, i0, i, live, dtype)
        squares += v * v
    inv = tl.rsqrt((tl.sum(squares, 0) / H + eps).to(tl.float32))  # fp64 eps in Inductor
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for i0 in range(0, H, BLOCK_H):
        live = i0 + i < H
        v = _residual(h_ptr, o_ptr, b, H, i0, i, live, dtype)
        w = tl.load(norm_ptr + i0 + i, mask=live, other=0.0).to(tl.float32)
        x = rms_scale(v, inv, w, dtype)
        if block == 0:
            tl.store(h_out_ptr + b * H + i0 + i, v.to(dtype), mask=live)
            tl.store(x_out_ptr + b * H + i0 + i, x.to(dtype), mask=live)
            tl.store(stage_ptr + b * H + i0 + i, x.to(tl.int32, bitcast=True), mask=live)
        r = tl.load(router_ptr + e[:, None] * H + (i0 + i)[None, :],
                    mask=(e < E)[:, None] & live[None, :], other=0.0)
        acc += r.to(tl.float32) * x[None, :]
    logits = tl.sum(acc, 1)
    if not LOGITS_FP32:
        logits = to_dtype(logits, dtype).to(tl.float32)
    tl.store(logits_ptr + b * E + e, logits, mask=e < E)


@triton.jit
def topk_kernel(logits_ptr, bias_ptr, x_ptr, stage_ptr, B, H, E, scaling, K: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
                BIAS: tl.constexpr, NORM: tl.constexpr, ROUND_WEIGHTS: tl.constexpr):
    """logits [B, E] -> stage[B H + (b K + k) 2 + {0, 1}] = id k as an int64's int32 words,
    stage[B H + 2 B K + b K + k] = weight k as fp32 bits (ops/router.py `route`, no group
    limit; BIAS: bias [E] added to the scores for the choice only); ROUND_WEIGHTS: to x's
    dtype."""
    b = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    e = tl.arange(0, BLOCK_E)
    live = e < E
    logits = tl.load(logits_ptr + b * E + e, mask=live, other=float("-inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        exps = tl.exp(logits - tl.max(logits, 0))
        scores = exps / tl.sum(exps, 0)
    scores = tl.where(live, scores, 0.0)
    choice = tl.where(live, scores, float("-inf"))
    if BIAS:
        choice += tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32)
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for pick in tl.static_range(K):
        best = tl.argmax(choice, 0, tie_break_left=True)
        ids = tl.where(k == pick, best, ids)
        weights = tl.where(k == pick, tl.sum(tl.where(e == best, scores, 0.0), 0), weights)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = (weights * scaling).to(tl.float32)  # fp64 scaling in Inductor
    if ROUND_WEIGHTS:
        weights = to_dtype(weights, dtype).to(tl.float32)
    pairs = stage_ptr + B * H + (b * K + k) * 2
    tl.store(pairs, ids, mask=k < K)
    tl.store(pairs + 1, ids >> 31, mask=k < K)
    tl.store(stage_ptr + B * H + 2 * B * K + b * K + k, weights.to(tl.int32, bitcast=True),
             mask=k < K)


@triton_op("hetmoe::moe_router", mutates_args=())
def moe_router(h: torch.Tensor, o: torch.Tensor, norm: torch.Tensor, eps: float,
               router: torch.Tensor, bias: torch.Tensor | None, top_k: int, sigmoid: bool,
               norm_topk_prob: bool, scaling: float, logits_fp32: bool, round_weights: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, o [B, H] (residual, o_proj output), norm [H], router [E, H] (bias [E] steers the
    choice only) -> (h + o, x = RMSNorm(h + o) [B, H] in h's dtype, the stage of ops/fused.py
    `pack_moe_inputs(x, ids, weights)`); `scaling` multiplies the weights (after the norm)."""
    b, hidden = h.shape
    experts = router.shape[0]
    if o.shape != h.shape or norm.shape != (hidden,) or router.shape != (experts, hidden):
        raise ValueError(f"moe_router: h / o [B, H], norm [H] and router [E, H] expected, got "
                         f"{tuple(h.shape)}, {tuple(o.shape)}, {tuple(norm.shape)} and "
                         f"{tuple(router.shape)}")
    if not 0 < top_k <= experts or (bias is not None and bias.shape != (experts,)):
        raise ValueError(f"moe_router: top_k {top_k} of {experts} experts, bias "
                         f"{None if bias is None else tuple(bias.shape)}: 1 <= top_k <= E "
                         f"and a bias of [{experts}] expected")
    h, o, router = h.contiguous(), o.contiguous(), router.contiguous()
    h_out, x = torch.empty_like(h), torch.empty_like(h)
    stage = h.new_empty(b * (hidden + 3 * top_k), dtype=torch.int32)
    logits = h.new_empty((b, experts), dtype=torch.float32)
    block_e = 8
    wrap_triton(logits_kernel)[(b, triton.cdiv(experts, block_e))](
        h, o, norm, router, h_out, x, stage, logits, hidden, experts, eps, BLOCK_E=block_e,
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)), LOGITS_FP32=logits_fp32)
    wrap_triton(topk_kernel)[(b,)](
        logits, logits if bias is None else bias, x, stage, b, hidden, experts, scaling,
        K=top_k, BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), SIGMOID=sigmoid, BIAS=bias is not None,
        NORM=norm_topk_prob, ROUND_WEIGHTS=round_weights)
    return h_out, x, stage
