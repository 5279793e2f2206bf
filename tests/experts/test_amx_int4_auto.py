"""HETMOE_AMX_INT4=auto (kernels/amx_int4_auto.cpp) one call at a time: a call whose rows are even
across their u8 groups runs the int8-tile kernel, bit for bit, and one whose rows have an outlier
group runs the bf16-tile kernel, bit for bit; the threshold (kAmxInt4AutoMaxSpread, 2) from both
sides. The variable's parsing and a layer under auto: test_amx_int4_i8.py."""

from __future__ import annotations

import pytest
import torch
from test_amx_int4_i8 import _call, amx, needs_amx  # noqa: F401 (amx: the fixture)

SPREAD = 2.0
"""kAmxInt4AutoMaxSpread (amx_int4_auto.h), and AUTO_MAX_SPREAD of the demo-moe benchmark."""


def _spread(x: torch.Tensor, group_size: int) -> float:
    """The call spread amx_int4_auto.cpp tests, sqrt(G sum_r max_g A^2 / sum_r sum_g A^2), on
    the group extremes of x [m, k] (A: the largest |x| of each group)."""
    a2 = x.double().view(x.shape[0], -1, group_size).abs().amax(-1).square()  # [m, G]
    return float((a2.shape[1] * a2.amax(1).sum() / a2.sum()).sqrt())


def _outlier_rows(m: int, k: int, group_size: int, top: float) -> torch.Tensor:
    """[m, k]: every group's values spread over [-1, 1] (both ends present), group 1's over
    [-top, top]: a call spread of sqrt(G top^2 / (top^2 + G - 1))."""
    g = torch.Generator().manual_seed(m + k)
    x = torch.rand(m, k, generator=g) * 2 - 1
    x[:, 0::group_size], x[:, 1::group_size] = -1.0, 1.0
    x[:, group_size:2 * group_size] *= top
    return x


def _kernels(w: torch.Tensor, x: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    return {kernel: _call(kernel, w, x, group_size)[0] for kernel in ("auto", "i8", "bf16")}


@needs_amx
@pytest.mark.parametrize(("m", "k", "group_size"), [(1, 256, 32), (40, 768, 32), (33, 512, 128),
                                                    (70, 2048, 32), (20, 2048, 128)])
def test_even_gaussian_rows_run_the_int8_tiles(m: int, k: int, group_size: int) -> None:
    """Gaussian rows (the speed benchmark's; call spread 1.3-1.6): auto gives the i8 kernel's
    floats."""
    g = torch.Generator().manual_seed(m * k)
    w = torch.randn(48, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    assert _spread(x, group_size) < SPREAD
    c = _kernels(w, x, group_size)
    assert torch.equal(c["auto"], c["i8"])
    assert not torch.equal(c["i8"], c["bf16"])


@needs_amx
@pytest.mark.parametrize(("top", "kernel"), [(2.1, "i8"), (2.4, "bf16"), (30.0, "bf16")])
def test_an_outlier_group_runs_the_bf16_tiles_past_the_threshold(top: float, kernel: str) -> None:
    """16 groups of 32, one group `top` times the others: spread 1.91 (under 2: int8 tiles),
    2.11 and 3.97 (bf16 tiles); auto's floats equal that kernel's, not the other's."""
    m, k, group_size = 24, 512, 32
    x = _outlier_rows(m, k, group_size, top)
    expected = (16 * top ** 2 / (top ** 2 + 15)) ** 0.5
    assert _spread(x, group_size) == pytest.approx(expected, rel=1e-6)
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(3)) * 0.05
    c = _kernels(w, x, group_size)
    other = "bf16" if kernel == "i8" else "i8"
    assert torch.equal(c["auto"], c[kernel])
    assert not torch.equal(c["auto"], c[other])


@needs_amx
def test_one_outlier_row_among_even_ones_keeps_the_int8_tiles() -> None:
    """The rule sums over the call's rows (their error in norm): one row of 70 with a 10x group
    leaves the call's spread under 2 (1.49); the same row alone (3.73) is refused."""
    m, k, group_size = 70, 512, 32
    x = _outlier_rows(m, k, group_size, 1.0)
    x[5] = _outlier_rows(1, k, group_size, 10.0)[0]
    assert _spread(x, group_size) < SPREAD < _spread(x[5:6], group_size)
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(4)) * 0.05
    assert torch.equal(_call("auto", w, x, group_size)[0], _call("i8", w, x, group_size)[0])
    alone = x[5:6].contiguous()
    assert torch.equal(_call("auto", w, alone, group_size)[0],
                       _call("bf16", w, alone, group_size)[0])
