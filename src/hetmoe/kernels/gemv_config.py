"""The decode step's projection kernels (kernels/norm_gemv.py, kernels/gemv_residual.py): which
calls take them (`gemv_fits`, by rows and dtype) and their launch shapes (`GemvConfig`).

A decode step's projections are GEMVs: B <= 8 rows against a weight read once from HBM (the
Qwen3-30B-A3B qkv weight is 21 MB a layer, o_proj 16.8 MB), so their time is the weight's bytes
over the memory's bandwidth. cuBLAS takes ~1.4-1.8x that floor there (qkv 9.7 us a call against
~7, o_proj 10 with its split-K reduce against ~5.6: gpu_kernels.md round 8); the kernels stream W
in blocks of rows, each block read once for all rows, with the norm before qkv and the residual
add after o_proj folded in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DECODE_GEMV_MAX_ROWS = 0
"""The fused decode step (engine/executor/fused_decode.py, its Triton path) projects with the
kernels up to this many rows (decode batches); more rows keep torch's GEMM (cuBLAS), where a
tensor-core GEMM's reuse of W across rows pays. 0 turns the kernels off: the default, because
on an H100 (2026-11-27) they lost to cuBLAS (qkv 14.4 against 11.9 us a call at one row, o_proj
even; greedy decode 271.6 against 281.0 tok/s, docs/benchmarks/gpu_kernels.md)."""

GEMV_DTYPES = (torch.bfloat16,)
"""Activation and weight dtypes the fused decode step projects with the kernels (the kernels
themselves also take fp16 and fp32): the served models' dtype, the one measured."""

MAX_KERNEL_ROWS = 16
"""The most rows a kernel call takes: its tile pads rows to 16 (tensor-core dots need 16), and
every row adds a [BLOCK_K] slice of registers; larger batches are GEMMs, not GEMVs."""


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of a projection kernel: programs over N (and K) and loads in flight."""

    block_n: int
    """Rows of W per program (output columns): 16, 32, 64 or 128."""
    block_k: int
    """Columns of W per loop step: a power of two from 32 to 1024."""
    split_k: int
    """Programs sharing a block's K loop: 1 (one pass, the epilogue in the program), or up to
    16, each writing fp32 partials that a second small launch sums in order and finishes."""
    num_warps: int
    """Warps per program: 1, 2, 4 or 8."""
    num_stages: int
    """Loop steps whose loads are in flight at once (Triton's software pipelining): 1 to 6."""

    def __post_init__(self) -> None:
        checks = [("block_n", (16, 32, 64, 128)), ("block_k", (32, 64, 128, 256, 512, 1024)),
                  ("split_k", range(1, 17)), ("num_warps", (1, 2, 4, 8)),
                  ("num_stages", range(1, 7))]
        for name, allowed in checks:
            value = getattr(self, name)
            if value not in allowed:
                shown = f"from {allowed[0]} to {allowed[-1]}" if isinstance(allowed, range) \
                    else "one of " + ", ".join(map(str, allowed))
                raise ValueError(f"GemvConfig: {name} must be {shown}, got {value}")

    def programs(self, n: int) -> int:
        """Programs of the main launch for N output columns."""
        return -(-n // self.block_n) * self.split_k


def parse_gemv_config(text: str) -> GemvConfig:
    """A `GemvConfig` from a command line: its 5 integer fields in order, comma-separated
    (block_n, block_k, split_k, num_warps, num_stages; e.g. "16,512,1,4,4")."""
    names = [f.name for f in dataclasses.fields(GemvConfig)]
    values = text.split(",")
    try:
        ints = [int(v) for v in values]
    except ValueError:
        ints = []
    if len(ints) != len(names):
        raise ValueError(f"gemv config {text!r}: {len(names)} comma-separated integers expected "
                         f"({', '.join(names)})")
    return GemvConfig(*ints)


NORM_GEMV_CONFIG = GemvConfig(block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=4)
"""qkv's shape (not yet measured: `bench_decode_layer.py --gemv-shapes` sweeps it): 16 rows of W a
program, so Qwen3-30B-A3B's N = 5120 makes 320 programs, each with 4 steps of 8 KB of W in
flight; its ~59 KB of shared memory (sm_90 build) lets 3 share an SM, so all 320 run at once on
an H100's 132 (at block_k 512, 117 KB: one an SM, 2.4 waves)."""

GEMV_CONFIG = GemvConfig(block_n=16, block_k=512, split_k=1, num_warps=4, num_stages=4)
"""o_proj's shape (not yet measured, as `NORM_GEMV_CONFIG`): N = 2048 makes 128 programs, one an
SM, each streaming 128 KB of W with 4 steps of 16 KB in flight; split_k 2 (256 programs and the
reduce launch, cuBLAS's choice) is the sweep's alternative."""


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused decode step projects x [B, K] by `weight` [N, K] with the kernels: at
    most `DECODE_GEMV_MAX_ROWS` rows, both in a `GEMV_DTYPES` dtype (a rule on the call's shape
    and dtype, decided when the step is traced; others run torch's linear)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= min(DECODE_GEMV_MAX_ROWS, MAX_KERNEL_ROWS)
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype)
