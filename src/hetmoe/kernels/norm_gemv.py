"""A decode step's projection with the RMSNorm before it as its prologue: y = RMSNorm(x) @ W^T.

The fused decode step's q/k/v projection (engine/executor/layer_functions.py: one GEMV over
`StaticKVAttention.fused_qkv`'s weight, after the layer's input norm), which otherwise runs as
an Inductor norm kernel and a cuBLAS GEMV: x [M, K] hidden rows (M <= 8 there,
`gemv_config.gemv_fits`), norm [K], W [N, K] bf16.

Each program (BLOCK_N rows of W, `GemvConfig`) first sums the squares of its M rows over all of
K (fp32; M K values read from L2 by every program, 4 KB a row at K = 2048; K is a constexpr, so
these loads are unrolled and in flight together, not one L2 trip a step), then in its loop over
K normalizes each x tile as ops/fused.py `rms_norm` rounds it (x / rms rounded to the dtype,
times the weight, rounded: `dequant.rms_scale`) and multiplies it with the tile of W (a
tensor-core dot or FMAs, `GemvConfig.dot`): each weight byte is read once for all rows. The
sums are rounded once, with the bias added before (torch's linear). The squares' sum runs in
another order than Inductor's, so a normalized value may differ by one rounding where its fp32
1/rms does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.kernels.dequant import rms_scale
from hetmoe.kernels.gemv_config import NORM_GEMV_CONFIGS, GemvConfig, config_for
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
def _inverse_rms(x_ptr, m, M, K: tl.constexpr, s_x, eps, BLOCK_M: tl.constexpr,
                 CHUNK: tl.constexpr):
    """[BLOCK_M] 1 / rms of rows m of x [M, K] in fp32 (rows past M: 1 / sqrt(eps)): the
    [BLOCK_M, CHUNK] chunks unrolled (K a constexpr), so their loads go out together."""
    kk = tl.arange(0, CHUNK)
    squares = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
    for k0 in tl.static_range(0, K, CHUNK):
        v = load_rows(x_ptr, m, k0 + kk, M, K, s_x, CHUNK).to(tl.float32)
        squares += v * v
    return tl.rsqrt((tl.sum(squares, 1) / K + eps).to(tl.float32))  # fp64 eps in Inductor


@triton.jit
def norm_gemv_kernel(x_ptr, norm_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N,
                     K: tl.constexpr, s_x, s_w, s_out, eps, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     BIAS: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                     CHUNK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (block of N, split of K): RMSNorm(x [M, K], norm [K]) times W [N, K] rows
    [pid 0 * BLOCK_N, +BLOCK_N) over its K share -> `finish` (out [M, N], + bias [N]; or the
    split's partials). PDL: launched as a programmatic dependent (kernels/pdl.py)."""
    wait_prior(PDL)
    dtype = x_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    inv = _inverse_rms(x_ptr, m, M, K, s_x, eps, BLOCK_M, CHUNK)[:, None]  # [BLOCK_M, 1]
    lo, hi = k_share(K, BLOCK_K, SPLIT_K)
    acc = new_sums(BLOCK_M, BLOCK_N, BLOCK_K, DOT)
    # num_stages on the loop itself: Triton pipelines a loop without a dot only when asked
    for k0 in tl.range(lo, hi, BLOCK_K, num_stages=STAGES):
        k = k0 + kk
        v = load_rows(x_ptr, m, k, M, K, s_x, BLOCK_K)
        g = tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        xn = rms_scale(v.to(tl.float32), inv, g[None, :], dtype)
        w = load_rows(w_ptr, n, k, N, K, s_w, BLOCK_K)
        acc = accumulate(xn.to(dtype), w, acc, DOT, IEEE)
    start_next(PDL)
    finish(row_sums(acc, DOT), m, n, M, N, out_ptr, s_out, bias_ptr, out_ptr, s_out, part_ptr,
           SPLIT_K, BIAS, False)


def norm_chunk(k: int, block_m: int) -> int:
    """Columns of the 1/rms prologue's chunks: ~2K values of x a chunk (16 a thread at 4 warps),
    K's power of two if smaller."""
    return min(triton.next_power_of_2(k), max(32, 2048 // block_m))


@torch.library.custom_op("hetmoe::norm_gemv", mutates_args=())
def _norm_gemv_op(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
                  bias: torch.Tensor | None, block_n: int, block_k: int, split_k: int,
                  num_warps: int, num_stages: int, dot: bool) -> torch.Tensor:
    """`norm_gemv` with its launch shape as integers (a torch op's arguments; a custom op,
    opaque to Inductor, which would drop the dependent launch of a kernel it launches)."""
    config = GemvConfig(block_n, block_k, split_k, num_warps, num_stages, dot)
    m, k = x.shape
    n = weight.shape[0]
    x, norm = x.contiguous(), norm.contiguous()
    out = x.new_empty((m, n))
    part = partials(x, n, config)
    norm_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, norm, weight, bias if bias is not None else out, out, part, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), eps, BLOCK_M=config.block_m(m), BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, BIAS=bias is not None, DOT=dot, IEEE=ieee(x.dtype),
        CHUNK=norm_chunk(k, config.block_m(m)), STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages, **launch_args(x.device))
    reduce_partials(part, out, bias, None, config)
    return out


@_norm_gemv_op.register_fake
def _(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
      bias: torch.Tensor | None, block_n: int, block_k: int, split_k: int, num_warps: int,
      num_stages: int, dot: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def norm_gemv(x: torch.Tensor, norm: torch.Tensor, eps: float, weight: torch.Tensor,
              bias: torch.Tensor | None = None, config: GemvConfig | None = None
              ) -> torch.Tensor:
    """x [M, K] (1 <= M <= 16), norm [K] (x's dtype), weight [N, K] (unit stride along K),
    bias [N] -> `F.linear(fused.rms_norm(x, norm, eps), weight, bias)` [M, N] in x's dtype
    (bf16, fp16 or fp32), in one launch (two with split K) as `config` says (None:
    `NORM_GEMV_CONFIGS`' for x's rows; a custom op: a compiled step calls it from its graph)."""
    check_projection("norm_gemv", x, weight, bias)
    if norm.shape != (x.shape[1],) or norm.dtype != x.dtype or norm.device != x.device:
        raise ValueError(f"norm_gemv: norm [{x.shape[1]}] of x's dtype {x.dtype} on {x.device} "
                         f"expected, got {tuple(norm.shape)} {norm.dtype} on {norm.device}")
    config = config or config_for(NORM_GEMV_CONFIGS, x.shape[0])
    return _norm_gemv_op(x, norm, eps, weight, bias, config.block_n, config.block_k,
                         config.split_k, config.num_warps, config.num_stages, config.dot)
