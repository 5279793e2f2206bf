"""The decode step's MoE layer entry after attention, in one kernel: residual, norm, router.

From o_proj's output to the packed inputs of the layer's experts (engine/executor/fused_decode.py's
layer tail), which Inductor otherwise spreads over ~5 kernels per layer:

    h += o -> x = RMSNorm(h) -> logits = router x -> softmax / sigmoid -> top-k -> weights
    -> stage = x (fp32 bits) | ids (int32 pairs) | weights (fp32 bits)   (ops/fused.py pack)

- `router_kernel`, one program per (row, block of experts): the residual add and the norm of
  the row (recomputed by each program: H values), the block's logits (`_logits_block`; the first
  block's program also stores h, x and x's part of the stage); then each program takes a ticket
  of its row, and the one that draws the row's last does the row's top-k (`_route_row`: the
  scores, K argmax passes, lowest id on ties as ops/router.py `top_k_ids`, the weights as the
  router's config says, its part of the stage) and puts the ticket back to 0. The tickets are
  the caller's (`row_tickets`, declared mutated): one launch per layer, no fill per call, and
  every call leaves them as it found them (a CUDA graph replays from zeros).
- Without tickets the same two bodies run as two launches, `logits_kernel` then `topk_kernel`
  (the form before the tickets, kept to time one against the other: the same values).

Routers whose choice no expert group limits (ops/router.py `RouterConfig.kernel_fits`): greedy
ones and `noaux_tc` ones with one group, whose bias steers the choice while the weights are the
unbiased scores; group-limited ones keep the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.kernels.dequant import rms_scale, to_dtype
from hetmoe.kernels.pdl import launch_args, start_next, wait_prior

ROUTER_BLOCK_E = 1
"""Experts per program of the logits: one, so E programs a row (Qwen3-30B-A3B: 128) share the
router's reads. Measured with `ROUTER_NUM_WARPS` and BLOCK_H 2048 on an H100 (bench_decode_layer.py
--router-shapes, Qwen3-30B-A3B, batch 1, 48 layers' graph replays): 5.81 us a call against 7.57
for the former 8 experts x 4 warps x 1024, the fastest of 31 shapes, stage bits unchanged
(docs/benchmarks/gpu_kernels.md)."""
ROUTER_NUM_WARPS = 1
"""Warps per program: one warp reads a program's row of weights and h (latency, not width, bounds
a 4 KB read)."""
ROUTER_BLOCK_H = 2048
"""The most hidden columns a program's tile holds (H rounded up to a power of two, if fewer):
one pass over h and the weights at H = 2048."""


def launch_shape(hidden: int, block_e: int, num_warps: int, block_h: int | None) -> int:
    """Checks `moe_router`'s launch shape -> BLOCK_H (None: min(ROUTER_BLOCK_H, H rounded up to
    a power of two)). Each logit is one program's dot product whatever the shape; BLOCK_H sets which
    lanes its sum (and the norm's) runs over, and on the GPU the tile's layout, which follows
    all three, sets the tree of those sums: a shape may move the values' last bits."""
    def power(v: int, top: int) -> bool:
        return 1 <= v <= top and v & (v - 1) == 0

    if not (power(block_e, 1024) and power(num_warps, 32)
            and (block_h is None or power(block_h, 1 << 16))):
        raise ValueError(f"moe_router: launch shape block_e {block_e}, num_warps {num_warps}, "
                         f"block_h {block_h}: powers of two expected (block_e 1..1024, "
                         f"num_warps 1..32, block_h 1..65536 or None)")
    return min(ROUTER_BLOCK_H, triton.next_power_of_2(hidden)) if block_h is None else block_h


@triton.jit
def _residual(h_ptr, o_ptr, b, H, i0, i, live, dtype: tl.constexpr):
    """Row b's h + o at columns i0 + i (where `live`, 0 elsewhere) in fp32, rounded to `dtype` as
    h_out holds it: both passes of `logits_kernel` read the same values."""
    v = tl.load(h_ptr + b * H + i0 + i, mask=live, other=0.0).to(tl.float32)
    v += tl.load(o_ptr + b * H + i0 + i, mask=live, other=0.0).to(tl.float32)
    return to_dtype(v, dtype).to(tl.float32)


@triton.jit
def _logits_block(h_ptr, o_ptr, norm_ptr, router_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, b, block, H, E, eps, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  LOGITS_FP32: tl.constexpr):
    """Row b, experts [block BLOCK_E, +BLOCK_E): h, o [B, H] -> logits [B, E] fp32 (rounded to
    h's dtype unless LOGITS_FP32); block 0 also stores h_out = h + o, x_out = RMSNorm(h_out)
    (h's dtype) and stage[b H + i] = x as fp32 bits."""
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
def _route_row(logits_ptr, bias_ptr, stage_ptr, b, B, H, E, scaling, dtype: tl.constexpr,
               K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
               SIGMOID: tl.constexpr, BIAS: tl.constexpr, NORM: tl.constexpr,
               ROUND_WEIGHTS: tl.constexpr):
    """Row b's logits [E] (BLOCK_E >= E) -> stage[B H + (b K + k) 2 + {0, 1}] = id k as an
    int64's int32 words, stage[B H + 2 B K + b K + k] = weight k as fp32 bits (ops/router.py
    `route`, no group limit; BIAS: bias [E] added to the scores for the choice only);
    ROUND_WEIGHTS: to `dtype`."""
    e = tl.arange(0, BLOCK_E)
    live = e < E
    # past L1 (.cg): other programs stored these logits in this launch, and this SM's L1 may
    # hold the line from another row's read (rows share lines where E is no multiple of 32)
    logits = tl.load(logits_ptr + b * E + e, mask=live, other=float("-inf"), cache_modifier=".cg")
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


@triton.jit
def router_kernel(h_ptr, o_ptr, norm_ptr, router_ptr, bias_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, tickets_ptr, B, H, E, eps, scaling, BLOCK_E: tl.constexpr,
                  BLOCK_H: tl.constexpr, LOGITS_FP32: tl.constexpr, K: tl.constexpr,
                  ALL_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
                  BIAS: tl.constexpr, NORM: tl.constexpr, ROUND_WEIGHTS: tl.constexpr,
                  PDL: tl.constexpr):
    """The one launch: `_logits_block`, then the program drawing its row's last ticket (tickets
    [>= B] int32, zeros) runs `_route_row` (ALL_E >= E) and puts the ticket back to 0. PDL:
    launched as a programmatic dependent (kernels/pdl.py)."""
    wait_prior(PDL)
    b = tl.program_id(0)
    _logits_block(h_ptr, o_ptr, norm_ptr, router_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, b, tl.program_id(1), H, E, eps, BLOCK_E, BLOCK_H, LOGITS_FP32)
    tl.debug_barrier()  # every thread's logits stored before the release below publishes them
    ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel", scope="gpu")
    start_next(PDL)
    if ticket == tl.num_programs(1) - 1:  # the row's other blocks have stored their logits
        _route_row(logits_ptr, bias_ptr, stage_ptr, b, B, H, E, scaling,
                   h_ptr.dtype.element_ty, K, ALL_E, BLOCK_K, SIGMOID, BIAS, NORM,
                   ROUND_WEIGHTS)
        tl.store(tickets_ptr + b, 0)  # every ticket drawn: the next launch starts from zero


@triton.jit
def logits_kernel(h_ptr, o_ptr, norm_ptr, router_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, H, E, eps, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  LOGITS_FP32: tl.constexpr, PDL: tl.constexpr):
    """The two launches' first: `_logits_block` per (row, block of experts)."""
    wait_prior(PDL)
    _logits_block(h_ptr, o_ptr, norm_ptr, router_ptr, h_out_ptr, x_out_ptr, stage_ptr,
                  logits_ptr, tl.program_id(0), tl.program_id(1), H, E, eps, BLOCK_E, BLOCK_H,
                  LOGITS_FP32)


@triton.jit
def topk_kernel(logits_ptr, bias_ptr, x_ptr, stage_ptr, B, H, E, scaling, K: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
                BIAS: tl.constexpr, NORM: tl.constexpr, ROUND_WEIGHTS: tl.constexpr,
                PDL: tl.constexpr):
    """The two launches' second: `_route_row` per row (weights rounded to x's dtype)."""
    wait_prior(PDL)
    _route_row(logits_ptr, bias_ptr, stage_ptr, tl.program_id(0), B, H, E, scaling,
               x_ptr.dtype.element_ty, K, BLOCK_E, BLOCK_K, SIGMOID, BIAS, NORM, ROUND_WEIGHTS)


def row_tickets(rows: int, device: torch.device | str) -> torch.Tensor:
    """`moe_router`'s tickets for batches of up to `rows` rows: int32 zeros [rows], which every
    call leaves at zero (own one per device and stream of calls, made once: a CUDA graph
    replays the address it captured)."""
    return torch.zeros(rows, dtype=torch.int32, device=device)


@torch.library.custom_op("hetmoe::moe_router", mutates_args=("tickets",))
def moe_router(h: torch.Tensor, o: torch.Tensor, norm: torch.Tensor, eps: float,
               router: torch.Tensor, bias: torch.Tensor | None, tickets: torch.Tensor | None,
               top_k: int, sigmoid: bool, norm_topk_prob: bool, scaling: float,
               logits_fp32: bool, round_weights: bool, *, block_e: int = ROUTER_BLOCK_E,
               num_warps: int = ROUTER_NUM_WARPS, block_h: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h, o [B, H] (residual, o_proj output), norm [H], router [E, H] (bias [E] steers the
    choice only) -> (h + o, x = RMSNorm(h + o) [B, H] in h's dtype, the stage of ops/fused.py
    `pack_moe_inputs(x, ids, weights)`); `scaling` multiplies the weights (after the norm).
    `tickets` (`row_tickets`, >= B rows, left at zero): one launch; None: two (same values).
    Launch shape (`launch_shape`): B x ceil(E / block_e) programs of `num_warps` warps, each
    reading H in chunks of `block_h`; the two launches' top-k keeps Triton's default warps."""
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
    if tickets is not None and (tickets.dtype != torch.int32 or tickets.dim() != 1
                                or tickets.shape[0] < b or tickets.device != h.device):
        raise ValueError(f"moe_router: tickets of >= {b} rows, int32 [rows] on {h.device} "
                         f"expected (row_tickets), got {tickets.dtype} "
                         f"{tuple(tickets.shape)} on {tickets.device}")
    block_h = launch_shape(hidden, block_e, num_warps, block_h)
    h, o, router = h.contiguous(), o.contiguous(), router.contiguous()
    h_out, x = torch.empty_like(h), torch.empty_like(h)
    stage = h.new_empty(b * (hidden + 3 * top_k), dtype=torch.int32)
    logits = h.new_empty((b, experts), dtype=torch.float32)
    grid = (b, triton.cdiv(experts, block_e))
    bias_or = logits if bias is None else bias  # BIAS off: never read
    pdl = launch_args(h.device)
    route = dict(K=top_k, BLOCK_K=max(2, triton.next_power_of_2(top_k)), SIGMOID=sigmoid,
                 BIAS=bias is not None, NORM=norm_topk_prob, ROUND_WEIGHTS=round_weights, **pdl)
    if tickets is not None:
        router_kernel[grid](
            h, o, norm, router, bias_or, h_out, x, stage, logits, tickets, b, hidden, experts,
            eps, scaling, BLOCK_E=block_e, BLOCK_H=block_h, LOGITS_FP32=logits_fp32,
            ALL_E=triton.next_power_of_2(experts), num_warps=num_warps, **route)
        return h_out, x, stage
    logits_kernel[grid](
        h, o, norm, router, h_out, x, stage, logits, hidden, experts, eps,
        BLOCK_E=block_e, BLOCK_H=block_h, LOGITS_FP32=logits_fp32, num_warps=num_warps, **pdl)
    topk_kernel[(b,)](
        logits, bias_or, x, stage, b, hidden, experts, scaling,
        BLOCK_E=triton.next_power_of_2(experts), **route)
    return h_out, x, stage


@moe_router.register_fake
def _(h: torch.Tensor, o: torch.Tensor, norm: torch.Tensor, eps: float, router: torch.Tensor,
      bias: torch.Tensor | None, tickets: torch.Tensor | None, top_k: int, sigmoid: bool,
      norm_topk_prob: bool, scaling: float, logits_fp32: bool, round_weights: bool, *,
      block_e: int = ROUTER_BLOCK_E, num_warps: int = ROUTER_NUM_WARPS,
      block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hidden = h.shape
    stage = h.new_empty(b * (hidden + 3 * top_k), dtype=torch.int32)
    return h.new_empty(h.shape), h.new_empty(h.shape), stage
