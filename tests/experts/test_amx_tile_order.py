"""Prefill rows written in AMX tile order: the gather and the gate/up epilogue store the rows of
experts on AMX tiles in tile order, which the AMX kernels read in place, while experts on other
kernels of the same call stay row-major. Experts of 1..200 rows, odd q and q not a multiple of
16, every format: within the format's bound of float64, int formats bit for bit on every ISA
(int4 on AMX: at least as close to float64, moe_oracle.check_int_isas)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_oracle import available_isas, check_int_isas, make_experts, rel_error

from hetmoe.experts import CpuMoE

# Rows per expert: one row, around one token tile, around two, and 200 (13 tiles, the last
# partial).
COUNTS = (200, 1, 15, 16, 17, 33)


def _skewed_routing(q: int, counts: tuple[int, ...], seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [q, 2]: expert 0 in slot 0 of its first counts[0] tokens, the other experts' rows in
    slot 1 (so each token's experts differ), -1 elsewhere; tokens shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((q, 2), -1, dtype=torch.int64)
    ids[: counts[0], 0] = 0
    rest = torch.cat([torch.full((n,), e, dtype=torch.int64)
                      for e, n in enumerate(counts) if e > 0])
    assert rest.numel() <= q
    ids[: rest.numel(), 1] = rest
    ids = ids[torch.randperm(q, generator=g)].contiguous()
    return ids, torch.rand(q, 2, generator=g)


def _outputs(fmt: str, group: int | None, hidden: int, inter: int, q: int, amx_min: int,
             isas: list[str], seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each ISA's output for a skewed call, and the float64 reference."""
    layer = make_experts(len(COUNTS), hidden, inter, seed=seed)
    x = torch.randn(q, hidden, generator=torch.Generator().manual_seed(seed + 1))
    ids, weights = _skewed_routing(q, COUNTS, seed + 2)
    outs = {}
    for isa in isas:
        moe = CpuMoE(len(COUNTS), hidden, inter, fmt, group_size=group, isa=isa,
                     amx_min_tokens=amx_min)
        moe.load(layer.gate, layer.up, layer.down)
        outs[isa] = moe.forward(x, ids, weights, out=torch.full_like(x, float("nan")))
    return outs, layer.reference(x, ids, weights)


# amx_min_tokens 1: every expert on AMX tiles; 16: the 1- and 15-row experts of the same call on
# AVX-512 (row-major) beside tiled ones. Groups of 32 give 32-byte tile rows, the others 64.
@pytest.mark.parametrize("amx_min", [1, 16])
@pytest.mark.parametrize(("fmt", "group", "bound"),
                         [("int8", 32, 2e-2), ("int8", 128, 2e-2), ("int4", 32, 0.15),
                          ("int4", 64, 0.2)])
def test_int_tile_order_same_bits_on_every_isa(fmt: str, group: int, bound: float,
                                               amx_min: int) -> None:
    """q=203 (odd), experts of 1..200 rows, H=256 / I=128: every ISA gives the same floats (int4
    on AMX: check_int_isas)."""
    outs, ref = _outputs(fmt, group, 256, 128, 203, amx_min, available_isas(), seed=91 + group)
    check_int_isas(fmt, outs, ref, bound)


@pytest.mark.parametrize("amx_min", [1, 16])
def test_bf16_tile_order(amx_min: int) -> None:
    """BF16, H=96 (a K chunk of 3 steps) / I=160, q=203: within 1e-2 of float64 on each of the
    two fastest ISAs and within 1e-4 of each other."""
    isas = available_isas()[-2:]
    outs, ref = _outputs("bf16", None, 96, 160, 203, amx_min, isas, seed=101)
    for isa, out in outs.items():
        assert rel_error(out, ref) <= 1e-2, isa
    if len(outs) == 2:
        a, b = outs.values()
        assert rel_error(a, b.double()) < 1e-4


# Fewer than 32 rows per expert: the down phase goes by output columns over every expert.
@pytest.mark.parametrize("q", [5, 13, 31])
@pytest.mark.parametrize(("fmt", "group"), [("bf16", None), ("int8", 64), ("int4", 32)])
def test_small_prefill_by_columns(fmt: str, group: int | None, q: int) -> None:
    """q of 5..31 (not multiples of 16), top-3 of 4 experts, every expert on AMX: int formats
    equal the AVX-512 kernels bit for bit (int4: check_int_isas), bf16 within 1e-4; all within
    bound of float64."""
    E, H, I = 4, 128, 128
    layer = make_experts(E, H, I, seed=111 + q)
    g = torch.Generator().manual_seed(112 + q)
    x = torch.randn(q, H, generator=g)
    ids = torch.rand(q, E, generator=g).argsort(dim=1)[:, :3].contiguous()
    weights = torch.rand(q, 3, generator=g)
    outs = {}
    for isa in available_isas()[-2:]:
        moe = CpuMoE(E, H, I, fmt, group_size=group, isa=isa, amx_min_tokens=1)
        moe.load(layer.gate, layer.up, layer.down)
        outs[isa] = moe.forward(x, ids, weights, out=torch.full_like(x, float("nan")))
    bound = {"bf16": 1e-2, "int8": 2e-2, "int4": 0.15}[fmt]
    ref = layer.reference(x, ids, weights)
    if fmt != "bf16":
        check_int_isas(fmt, outs, ref, bound)
        return
    for isa, out in outs.items():
        assert rel_error(out, ref) <= bound, isa
    if len(outs) == 2:
        a, b = outs.values()
        assert rel_error(a, b.double()) < 1e-4


def test_tile_order_repeatable() -> None:
    """The same prefill call twice (the workspace reused) gives the same floats."""
    layer = make_experts(len(COUNTS), 128, 96, seed=121)
    x = torch.randn(203, 128, generator=torch.Generator().manual_seed(122))
    ids, weights = _skewed_routing(203, COUNTS, 123)
    moe = CpuMoE(len(COUNTS), 128, 96, "bf16", amx_min_tokens=1)
    moe.load(layer.gate, layer.up, layer.down)
    first = moe.forward(x, ids, weights)
    assert torch.equal(moe.forward(x, ids, weights), first)


_GROUPS_SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from moe_oracle import make_experts
from test_amx_tile_order import COUNTS, _skewed_routing
from hetmoe.experts import CpuMoE
out = {{}}
for fmt in ("bf16", "int8"):
    layer = make_experts(len(COUNTS), 128, 192, seed=131)
    x = torch.randn(203, 128, generator=torch.Generator().manual_seed(132))
    ids, weights = _skewed_routing(203, COUNTS, 133)
    moe = CpuMoE(len(COUNTS), 128, 192, fmt, group_size=32 if fmt == "int8" else None,
                 amx_min_tokens=16)
    moe.load(layer.gate, layer.up, layer.down)
    out[fmt] = (moe.num_groups, moe.forward(x, ids, weights))
torch.save(out, sys.argv[1])
"""


def test_numa_groups_equal_one(tmp_path: Path) -> None:
    """Two (virtual) NUMA groups split the gather's 21 row blocks unevenly (the second group's
    last task has none) and each keep their hidden slice in tile order: the result equals one
    group's up to the fp32 order of adding the groups' partial rows."""
    outs, groups = {}, 2
    for n in (1, groups):
        env = dict(os.environ, HETMOE_NUMA_GROUPS=str(n), HETMOE_THREADS="2")
        path = tmp_path / f"{n}.pt"
        script = _GROUPS_SCRIPT.format(here=str(Path(__file__).parent))
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True,
                       timeout=120)
        outs[n] = torch.load(path)
    for fmt, (num_groups, out) in outs[groups].items():
        assert num_groups == groups
        one = outs[1][fmt][1]
        assert float((out - one).norm() / one.norm()) < 1e-6, fmt
