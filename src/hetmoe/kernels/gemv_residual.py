"""A decode step's projection with the residual add as its epilogue: out = h + x @ W^T.

The fused decode step's o_proj (engine/executor/fused_decode.py): x [M, K] attention output
(M <= 8 rows there, `gemv_config.gemv_fits`), W [N, K] bf16 read once for all rows by programs of
BLOCK_N rows of W (`GemvConfig`: a tensor-core dot a step, or FMAs of the real rows), fp32 sums
rounded once as torch's linear rounds them, then
h + that rounded again (`fused.residual`'s `h + o`). Without h it is the plain projection: the
MoE layers' o_proj, whose residual add kernels/moe_router.py does with the norm and router.
With split K a second small launch sums the partials (kernels/gemv_tiles.py `reduce_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.kernels.gemv_config import GEMV_CONFIGS, GemvConfig, config_for
from hetmoe.kernels.gemv_tiles import (
    accumulate,
    check_projection,
    finish,
    ieee,
    k_share,
    load_rows,
    new_sums,
    partials,
    reduce_partials,
    row_sums,
)
from hetmoe.kernels.pdl import launch_args, start_next, wait_prior


@triton.jit
def gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, M, N, K: tl.constexpr, s_x,
                s_w, s_res, s_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BIAS: tl.constexpr,
                RESIDUAL: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (block of N, split of K): x [M, K] (rows s_x apart) times W [N, K] rows
    [pid 0 * BLOCK_N, +BLOCK_N) over its K share -> `finish` (out [M, N], + bias [N], + res
    [M, N] rounded after the product's rounding; or the split's partials). PDL: launched as a
    programmatic dependent (kernels/pdl.py)."""
    wait_prior(PDL)
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    lo, hi = k_share(K, BLOCK_K, SPLIT_K)
    acc = new_sums(BLOCK_M, BLOCK_N, BLOCK_K, DOT)
    # num_stages on the loop itself: Triton pipelines a loop without a dot only when asked
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        xt = load_rows(x_ptr, m, k, M, K, s_x, BLOCK_K)
        w = load_rows(w_ptr, n, k, N, K, s_w, BLOCK_K)
        acc = accumulate(xt, w, acc, DOT, IEEE)
    start_next(PDL)
    finish(row_sums(acc, DOT), m, n, M, N, out_ptr, s_out, bias_ptr, res_ptr, s_res, part_ptr,
           SPLIT_K, BIAS, RESIDUAL)


@torch.library.custom_op("hetmoe::gemv_residual", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             h: torch.Tensor | None, block_n: int, block_k: int, split_k: int, num_warps: int,
             num_stages: int, dot: bool) -> torch.Tensor:
    """`gemv_residual` with its launch shape as integers (a torch op's arguments; a custom op,
    opaque to Inductor, which would drop the dependent launch of a kernel it launches)."""
    config = GemvConfig(block_n, block_k, split_k, num_warps, num_stages, dot)
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()  # M rows: a copy at most of a few KB
    h = h.contiguous() if h is not None else None
    out = x.new_empty((m, n))
    part = partials(x, n, config)
    res = h if h is not None else out  # RESIDUAL off: never read
    gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, bias if bias is not None else out, res, out, part, m, n, k, x.stride(0),
        weight.stride(0), res.stride(0), out.stride(0), BLOCK_M=config.block_m(m),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, BIAS=bias is not None,
        RESIDUAL=h is not None, DOT=dot, IEEE=ieee(x.dtype), STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages, **launch_args(x.device))
    reduce_partials(part, out, bias, h, config)
    return out


@_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor | None,
      block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
      dot: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def gemv_residual(x: torch.Tensor, weight: torch.Tensor, h: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, config: GemvConfig | None = None
                  ) -> torch.Tensor:
    """x [M, K] (1 <= M <= 16), weight [N, K] (unit stride along K), bias [N], h [M, N] ->
    h + (x @ weight^T + bias) [M, N] in x's dtype (bf16, fp16 or fp32): the product rounded
    once, as `F.linear` rounds it, then the sum with h rounded (`fused.residual`); h None: the
    projection alone. Launched as `config` says (None: `GEMV_CONFIGS`' for x's rows; a
    custom op: a compiled step calls it from its graph)."""
    check_projection("gemv_residual", x, weight, bias, h)
    config = config or config_for(GEMV_CONFIGS, x.shape[0])
    return _gemv_op(x, weight, bias, h, config.block_n, config.block_k, config.split_k,
                    config.num_warps, config.num_stages, config.dot)
