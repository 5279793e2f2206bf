"""FP8 block-scaled weights (DeepSeek-V3 style): dequantized at load, or kept as they are for
owners that compute on them (the cpu experts' fp8 format: `Fp8Weight`). Here, below `inject/` and
`loading/`, so that every layer can name them; `loading/fp8.py` reads a config's scheme.

A weight [O, I] is stored as float8 with a `weight_scale_inv` [ceil(O/B), ceil(I/B)] in float32:
every B×B block of the weight is multiplied by its one scale (edge blocks are partial).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Stored dtypes that need a scale before they mean anything."""


@dataclass(frozen=True)
class Fp8Scheme:
    """Block scaling of an FP8 checkpoint (config.json's `quantization_config`)."""

    block_rows: int
    """Rows of one scaled block (B of [B, B])."""
    block_cols: int
    """Columns of one scaled block."""

    def cpu_expert_format(self, fmt: str | None) -> tuple[str | None, int | None]:
        """The cpu experts' format (`fmt`, None: fp8 when the blocks are whole 32-column groups)
        and, for fp8, a group that divides the scale blocks (None: the format's default)."""
        if fmt is None and self.block_cols % 32 == 0:
            fmt = "fp8"
        if fmt != "fp8" or self.block_cols % 128 == 0:
            return fmt, None
        return fmt, next((g for g in (64, 32) if self.block_cols % g == 0), 32)

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape of the `weight_scale_inv` that goes with a weight of `weight_shape`."""
        rows, cols = weight_shape
        return math.ceil(rows / self.block_rows), math.ceil(cols / self.block_cols)

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """float32 [O, I] = weight [O, I] × scale_inv broadcast over its B×B blocks."""
        rows, cols = weight.shape
        scale = scale_inv.float().repeat_interleave(self.block_rows, 0)[:rows]
        scale = scale.repeat_interleave(self.block_cols, 1)[:, :cols]  # [O, I]
        return weight.float() * scale


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight as stored, handed to a `load_tensor` owner that keeps FP8 (`keeps_fp8`)."""

    weight: torch.Tensor
    """The float8 codes [O, I]."""
    scale_inv: torch.Tensor
    """Its block scales [ceil(O/B0), ceil(I/B1)] (float32)."""
    scheme: Fp8Scheme
    """The block shape."""

    @property
    def shape(self) -> torch.Size:
        """The weight's shape."""
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [O, I]."""
        return self.scheme.dequantize(self.weight, self.scale_inv)
