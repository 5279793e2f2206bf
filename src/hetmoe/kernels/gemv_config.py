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

from hetmoe.kernels.pair_config import check_choices

DECODE_GEMV_MAX_ROWS = 2
"""The fused decode step (engine/executor/fused_decode.py, its Triton path) projects with the
kernels up to this many rows (decode batches); more rows keep torch's GEMM (cuBLAS), where a
tensor-core GEMM's reuse of W across rows pays. 0 turns the kernels off. 2: on an H100
(2026-11-27, c334b6a's FMA path) the kernels beat cuBLAS at 1 and 2 rows (qkv with its norm 9.96
against 11.18 us a call at one row, o_proj 7.85 against 10.01; greedy decode with every expert
resident 295.3 against 281.3 tok/s) and lost at 4 and 8 (qkv 15.5 against 12.2 us at 4 rows;
docs/benchmarks/gpu_kernels.md)."""

GEMV_DTYPES = (torch.bfloat16,)
"""Activation and weight dtypes the fused decode step projects with the kernels (the kernels
themselves also take fp16 and fp32): the served models' dtype, the one measured."""

MAX_KERNEL_ROWS = 16
"""The most rows a kernel call takes: every row adds registers (a [BLOCK_K] slice, or the FMA
path's [BLOCK_N, BLOCK_K] partial sums); larger batches are GEMMs, not GEMVs."""


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of a projection kernel: programs over N (and K), loads in flight, and how a
    step multiplies (tensor-core dot or FMA)."""

    block_n: int
    """Rows of W per program (output columns): 4 to 128 (16 at least with `dot`)."""
    block_k: int
    """Columns of W per loop step: a power of two from 32 to 1024."""
    split_k: int
    """Programs sharing a block's K loop: 1 (one pass, the epilogue in the program), or up to
    16, each writing fp32 partials that a second small launch sums in order and finishes."""
    num_warps: int
    """Warps per program: 1, 2, 4 or 8."""
    num_stages: int
    """Loop steps whose loads are in flight at once (Triton's software pipelining): 1 to 6."""
    dot: bool = True
    """A step as a tensor-core dot (rows padded to 16), else as FMAs of the real rows (rows
    padded to a power of two) into [rows, BLOCK_N, BLOCK_K] fp32 partials summed over K once
    at the end: no padding waste at 1-4 rows, more registers a row."""

    def __post_init__(self) -> None:
        checks = [("block_n", (4, 8, 16, 32, 64, 128)),
                  ("block_k", (32, 64, 128, 256, 512, 1024)), ("split_k", range(1, 17)),
                  ("num_warps", (1, 2, 4, 8)), ("num_stages", range(1, 7))]
        check_choices("GemvConfig", self, checks)
        if self.dot and self.block_n < 16:
            raise ValueError(f"GemvConfig: a tensor-core dot needs block_n >= 16, got "
                             f"{self.block_n} (dot=0 multiplies by FMAs)")

    def programs(self, n: int) -> int:
        """Programs of the main launch for N output columns."""
        return -(-n // self.block_n) * self.split_k

    def block_m(self, m: int) -> int:
        """Rows of the program's tile for m rows: 16 for a dot (its least), else m's power of
        two."""
        return 16 if self.dot else 1 << (m - 1).bit_length()

    def fma_registers(self, m: int) -> int:
        """fp32 partial sums a thread holds on the FMA path (0 with a dot): ptxas spills past
        ~128, so the sweep leaves such shapes out."""
        threads = 32 * self.num_warps
        return 0 if self.dot else self.block_m(m) * self.block_n * self.block_k // threads


def parse_gemv_config(text: str) -> GemvConfig:
    """A `GemvConfig` from a command line: its 6 integer fields in order, comma-separated
    (block_n, block_k, split_k, num_warps, num_stages, dot 1/0; e.g. "16,512,1,4,4,1")."""
    names = [f.name for f in dataclasses.fields(GemvConfig)]
    values = text.split(",")
    try:
        ints = [int(v) for v in values]
    except ValueError:
        ints = []
    if len(ints) != len(names) or ints[-1] not in (0, 1):
        raise ValueError(f"gemv config {text!r}: {len(names)} comma-separated integers expected "
                         f"({', '.join(names)}; dot 0 or 1)")
    block_n, block_k, split_k, num_warps, num_stages, dot = ints
    return GemvConfig(block_n, block_k, split_k, num_warps, num_stages, bool(dot))


RowConfigs = tuple[tuple[int, GemvConfig], ...]
"""Launch shapes by rows: (most rows, config) pairs in rising order, the last for up to
`MAX_KERNEL_ROWS`."""

NORM_GEMV_CONFIGS: RowConfigs = (
    (4, GemvConfig(block_n=8, block_k=256, split_k=1, num_warps=4, num_stages=4, dot=False)),
    (MAX_KERNEL_ROWS, GemvConfig(block_n=16, block_k=256, split_k=1, num_warps=4,
                                 num_stages=4)),
)
"""qkv's shapes (measured at 1-8 rows against cuBLAS on an H100, 2026-11-27, gpu_kernels.md round
9: ahead at 1 and 2 rows, behind at 4 and 8; `bench_decode_layer.py --gemv-shapes` sweeps others,
not yet run): up to 4 rows FMAs over 8 rows of W a program (Qwen3-30B-A3B's N = 5120: 640
programs, ~5 an SM, each with 4 steps of 4 KB of W in flight), more rows the tensor-core dot over
16 (320 programs)."""

GEMV_CONFIGS: RowConfigs = (
    (4, GemvConfig(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=4, dot=False)),
    (MAX_KERNEL_ROWS, GemvConfig(block_n=16, block_k=512, split_k=1, num_warps=4,
                                 num_stages=4)),
)
"""o_proj's shapes (measured as `NORM_GEMV_CONFIGS`': ahead of cuBLAS at 1, 2 and 4 rows, behind
at 8): N = 2048 makes 512 programs of 4 rows of W up to 4 rows (4 steps of 4 KB in flight each),
else 128 of 16 (one an SM, 4 steps of 16 KB)."""


def config_for(configs: RowConfigs, m: int) -> GemvConfig:
    """The launch shape of `configs` for m rows."""
    for rows, config in configs:
        if m <= rows:
            return config
    raise ValueError(f"gemv: no launch shape for {m} rows (at most {configs[-1][0]})")


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused decode step projects x [B, K] by `weight` [N, K] with the kernels: at
    most `DECODE_GEMV_MAX_ROWS` rows, both in a `GEMV_DTYPES` dtype (a rule on the call's shape
    and dtype, decided when the step is traced; others run torch's linear)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= min(DECODE_GEMV_MAX_ROWS, MAX_KERNEL_ROWS)
            and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype)
