"""What the projection kernels (kernels/norm_gemv.py, kernels/gemv_residual.py) share: their
argument checks, a loop step's loads and product with a tile of W, and their end (the epilogue,
or with split K the partials and the small launch that sums them: `reduce_kernel`).

Shapes: x [M, K] rows (M <= 16) in a [BLOCK_M, BLOCK_K] tile (`GemvConfig.block_m`: 16 for a
tensor-core dot, else M's power of two), W [N, K] row-major, out [M, N]. A program owns BLOCK_N
rows of W (and a K share when split), so each weight byte is read once for all M rows. K is a
constexpr (a model has two): the steps need no K mask where BLOCK_K divides it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.kernels.dequant import INTERPRETED, to_dtype
from hetmoe.kernels.gemv_config import MAX_KERNEL_ROWS, GemvConfig
from hetmoe.kernels.pdl import launch_args, wait_prior

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_projection(name: str, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> None:
    """ValueError naming `name` and the tensor when x [M, K] (1 <= M <= 16), weight [N, K]
    (unit stride along K), bias [N] or residual [M, N] do not fit together (shape, dtype,
    device)."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_KERNEL_ROWS:
        raise ValueError(f"{name}: x [M, K] with 1 <= M <= {MAX_KERNEL_ROWS} rows expected "
                         f"(a decode batch), got {tuple(x.shape)}")
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"{name}: weight [N, {k}] with unit stride along K expected, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    n = weight.shape[0]
    for what, t, shape in (("bias", bias, (n,)), ("residual", residual, (m, n))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name}: {what} {list(shape)} expected, got {tuple(t.shape)}")
    for what, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name}: {what} is {t.dtype} on {t.device}, x {x.dtype} on "
                             f"{x.device}: one dtype and device expected")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: x of dtype bfloat16, float16 or float32 expected, got "
                         f"{x.dtype}")


@triton.jit
def load_rows(ptr, m, k, M, K: tl.constexpr, s_row, BLOCK_K: tl.constexpr):
    """[len(m), len(k)] of a row-major matrix (rows s_row apart); rows m >= M and, where
    BLOCK_K does not divide K, columns k >= K read as 0."""
    if K % BLOCK_K == 0:
        mask = (m < M)[:, None]  # no K mask
    else:
        mask = (m < M)[:, None] & (k < K)[None, :]
    return tl.load(ptr + m[:, None] * s_row + k[None, :], mask=mask, other=0.0)


@triton.jit
def new_sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT: tl.constexpr):
    """A program's zero sums: [BLOCK_M, BLOCK_N] for dots, [BLOCK_M, BLOCK_N, BLOCK_K] for
    FMAs (one per K lane: no cross-thread sum until the end)."""
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def accumulate(xt, w, acc, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + xt [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] (the tile of W): DOT a dot into
    [BLOCK_M, BLOCK_N] (IEEE: in fp32), else FMAs into [BLOCK_M, BLOCK_N, BLOCK_K] (16-bit
    products are exact in fp32, so a dot's and an FMA's products are the same values)."""
    if not DOT:
        acc = acc + xt.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    elif IEEE:
        acc = tl.dot(xt.to(tl.float32), tl.trans(w).to(tl.float32), acc,
                     input_precision="ieee")
    else:
        acc = tl.dot(xt, tl.trans(w), acc)
    return acc


@triton.jit
def row_sums(acc, DOT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 sums of `new_sums`' accumulator (the FMA lanes summed over K)."""
    if not DOT:
        acc = tl.sum(acc, 2)
    return acc


def ieee(dtype: torch.dtype) -> bool:
    """Whether the dots run in fp32 (fp32 inputs: no TF32; the interpreter: it multiplies 16-bit
    operands as raw bits) rather than on 16-bit tensor cores (exact products, fp32 sums)."""
    return dtype == torch.float32 or bool(INTERPRETED)


@triton.jit
def k_share(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """(first, end) of this program's share of the K loop: whole BLOCK_K steps, split
    `program_id(1)` of SPLIT_K (the last shares may be short or empty)."""
    share = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = tl.program_id(1) * share
    return lo, tl.minimum(K, lo + share)


@triton.jit
def store_rows(acc, m, n, M, N, out_ptr, s_out, bias_ptr, res_ptr, s_res, BIAS: tl.constexpr,
               RESIDUAL: tl.constexpr):
    """out[m, n] = acc (+ bias[n], in fp32) rounded to out's dtype, as torch's linear rounds its
    fp32 sums once; RESIDUAL: then res[m, n] + that, rounded again (the `h + o` after it)."""
    dtype = out_ptr.dtype.element_ty
    live = (m < M)[:, None] & (n < N)[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    y = to_dtype(acc, dtype).to(tl.float32)
    if RESIDUAL:
        h = tl.load(res_ptr + m[:, None] * s_res + n[None, :], mask=live, other=0.0)
        y = to_dtype(h.to(tl.float32) + y, dtype).to(tl.float32)
    tl.store(out_ptr + m[:, None] * s_out + n[None, :], y.to(dtype), mask=live)


@triton.jit
def finish(acc, m, n, M, N, out_ptr, s_out, bias_ptr, res_ptr, s_res, part_ptr,
           SPLIT_K: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    """A main program's end: the epilogue (`store_rows`), or with SPLIT_K > 1 its fp32 partial
    sums into part [SPLIT_K, M, N] for `reduce_kernel`."""
    if SPLIT_K == 1:
        store_rows(acc, m, n, M, N, out_ptr, s_out, bias_ptr, res_ptr, s_res, BIAS, RESIDUAL)
    else:
        live = (m < M)[:, None] & (n < N)[None, :]
        at = (tl.program_id(1) * M + m[:, None]) * N + n[None, :]
        tl.store(part_ptr + at, acc, mask=live)


@triton.jit
def reduce_kernel(part_ptr, out_ptr, bias_ptr, res_ptr, M, N, s_out, s_res,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                  BIAS: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """Split K's second launch, one program per BLOCK_N columns: the SPLIT_K partials summed in
    split order (fp32), then `store_rows` (PDL: kernels/pdl.py)."""
    wait_prior(PDL)
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (m < M)[:, None] & (n < N)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m[:, None]) * N + n[None, :], mask=live, other=0.0)
    store_rows(acc, m, n, M, N, out_ptr, s_out, bias_ptr, res_ptr, s_res, BIAS, RESIDUAL)


def partials(x: torch.Tensor, n: int, config: GemvConfig) -> torch.Tensor:
    """The fp32 partials [SPLIT_K * M * N] of a split launch (flat; one element without a split:
    the kernels never touch it then)."""
    size = config.split_k * x.shape[0] * n if config.split_k > 1 else 1
    return x.new_empty((size,), dtype=torch.float32)


def reduce_partials(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, config: GemvConfig) -> None:
    """The second launch of a split config (none without a split)."""
    if config.split_k == 1:
        return
    m, n = out.shape
    res = residual if residual is not None else out
    reduce_kernel[(triton.cdiv(n, 128),)](
        part, out, bias if bias is not None else out, res, m, n, out.stride(0), res.stride(0),
        BLOCK_M=config.block_m(m), BLOCK_N=128, SPLIT_K=config.split_k, BIAS=bias is not None,
        RESIDUAL=residual is not None, num_warps=4, **launch_args(out.device))
