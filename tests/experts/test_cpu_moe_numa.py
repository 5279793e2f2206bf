"""NUMA tensor parallelism: two (virtual) groups split the intermediate dim and equal one group.

Equal to fp32 summation order (1e-6), except int4 on the AMX int8-tile kernel (opt-in,
HETMOE_AMX_INT4=i8), which requantizes each down-projection row to int8 over the K it is
given: one rs = max |h| / 127 over the whole intermediate row h with one group, one rs_g per half
with two. On the half holding the row's max rs_g = rs: the same row grid. On the other half
rs_g < rs and the two runs round h_k onto different grids: d_k = rs r_k - rs_g r'_k with r, r'
the rounding errors, modelled as independent uniform on [-1/2, 1/2]: Var d_k = (rs^2 + rs_g^2) /
12. The layer's output n of token t moves by sum_e wt_e sum_k down_e[n, k] d_k (wt_e: the
token's routing weights on e, summed where it picks e twice: the same errors twice), so
E ||two - one||^2 = sum over (token, expert) rows on AMX tiles (experts of >= amx_min_tokens rows)
of wt_e^2 (rs^2 + rs_g^2) / 12 sum_n sum_(k in that half) down_e[n, k]^2 (`_requant_spread`, from
the float64 reference's h and unquantized weights). Left out of the model: each weight channel's
grid S_n (its largest group end over the K given) also differs per half where that end lies in
the other half, a smaller second term (a float64 simulation of both: 0.0148 at q = 40, against
0.0133 for the rows alone). The bound is twice its root (slack for that term and for h and the
weights being the int4 layer's, ~13 % off the reference's; the norm sums thousands of
independent terms, so it hardly spreads about its root) plus the fp32 1e-6. Measured at q = 40
(on AMX and, the same floats, emulated): 0.0144 relative (int4) against a root of 0.0137, bound
0.0274; int4-odd 0.0141 / 0.0129; q = 200: 0.0147 / 0.0137 and 0.0133 / 0.0120."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_oracle import make_experts

from hetmoe import _cpu

# (name, format, hidden, intermediate, group size): int8 with 128-wide groups over 384 = 128 + 256
# columns per NUMA group, which decode computes in 64-column parts.
# Odd sizes (H = 72, I = 200: zero-padded inside) in every format.
CASES = [("bf16", "bf16", 128, 320, None), ("int8", "int8", 128, 320, None),
         ("int4", "int4", 128, 320, None), ("int8-128", "int8", 128, 384, 128),
         ("bf16-odd", "bf16", 72, 200, None), ("int8-odd", "int8", 72, 200, None),
         ("int4-odd", "int4", 72, 200, None)]
INT4_CASES = [case for case in CASES if case[1] == "int4"]
AMX_MIN_TOKENS = 8
FP32_ORDER = 1e-6
"""Relative difference of the halves' fp32 summation order alone."""

SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from moe_oracle import make_experts
from hetmoe import _cpu
from hetmoe.experts import CpuMoE
CASES = {cases!r}
out = {{"kernel": (_cpu.best_isa(), _cpu.amx_int4_kernel())}}
for name, fmt, hidden, inter, group in CASES:
    w = make_experts(5, hidden, inter, seed=31)
    moe = CpuMoE(5, hidden, inter, fmt, group_size=group, amx_min_tokens={min_tokens})
    moe.load(w.gate, w.up, w.down)
    g = torch.Generator().manual_seed(32)
    x = torch.randn({q}, hidden, generator=g)
    ids = torch.randint(-1, 5, ({q}, 4), generator=g)
    wts = torch.rand({q}, 4, generator=g)
    begins = [g.begin for g in moe.packed_groups()]
    out[name] = (moe.num_groups, begins, x, ids, wts, moe.forward(x, ids, wts))
torch.save(out, sys.argv[1])
"""


def _run(groups: int, q: int, path: Path, cases: list = CASES, kernel: str | None = None) -> dict:
    """The cases' outputs with `groups` NUMA groups (HETMOE_AMX_INT4 = kernel where given)."""
    env = dict(os.environ, HETMOE_NUMA_GROUPS=str(groups), HETMOE_THREADS="2")
    if kernel is not None:
        env["HETMOE_AMX_INT4"] = kernel
    script = SCRIPT.format(here=str(Path(__file__).parent), q=q, cases=cases,
                           min_tokens=AMX_MIN_TOKENS)
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=120)
    return torch.load(path)


def _requant_spread(case: tuple, run: tuple, split: int) -> float:
    """sqrt(E ||two - one||^2) of int4 on int8 tiles (module docstring), from float64; `split`:
    the first intermediate row of the two-group layer's second group."""
    _, _, hidden, inter, _ = case
    _, _, x, ids, wts, _ = run
    layer = make_experts(5, hidden, inter, seed=31)
    var = torch.zeros(x.shape, dtype=torch.float64)  # [q, H]
    for e in range(5):
        rows = ids == e  # [q, 4]
        if int(rows.sum()) < AMX_MIN_TOKENS:  # on AVX-512: integer sums, no requantization
            continue
        tok = rows.any(1).nonzero()[:, 0]
        # A token routed to e twice has the same rounding errors twice: its weights add first.
        wt = (wts * rows).sum(1)[tok].double()  # [n]
        xe = x[tok].double()
        h = torch.nn.functional.silu(xe @ layer.gate[e].double().T) * (
            xe @ layer.up[e].double().T)  # [n, I]
        rs = h.abs().amax(1, keepdim=True) / 127  # [n, 1]
        for half in (slice(0, split), slice(split, inter)):
            rs_g = h[:, half].abs().amax(1, keepdim=True) / 127
            step_var = torch.where(rs_g < rs, (rs**2 + rs_g**2) / 12, 0.0)  # [n, 1]
            down_sq = layer.down[e][:, half].double().pow(2).sum(1)  # [H]
            var.index_add_(0, tok, wt.pow(2)[:, None] * step_var * down_sq)
    return float(var.sum().sqrt())


def _check(one: dict, two: dict, cases: list) -> list[str]:
    """Each case's two-group output against one group's: exact up to fp32 order, int4 on the
    int8-tile kernel within twice the requantization spread; the cases run on that bound."""
    requantized = []
    for case in cases:
        name = case[0]
        assert one[name][0] == 1 and two[name][0] == 2
        a, b = one[name][-1], two[name][-1]
        diff = float((a - b).norm() / a.norm())
        if case[1] == "int4" and one["kernel"] == ("amx", "i8"):
            split = two[name][1][1]  # the layer's own split (PackedGroup.begin)
            bound = 2 * _requant_spread(case, one[name], split) / float(a.norm()) + FP32_ORDER
            requantized.append(name)
        else:  # same packed values and activations; only the fp32 summation order differs
            bound = FP32_ORDER
        assert diff < bound, (name, one["kernel"], diff, bound)
    return requantized


# 3: decode (tokens converted once, groups split); 200: >= 32 rows per expert, the prefill down
# path.
@pytest.mark.parametrize("q", [3, 40, 200])
def test_two_groups_equal_one(tmp_path: Path, q: int) -> None:
    one, two = _run(1, q, tmp_path / "one.pt"), _run(2, q, tmp_path / "two.pt")
    assert one["kernel"] == two["kernel"] == (_cpu.best_isa(), _cpu.amx_int4_kernel())
    _check(one, two, CASES)


@pytest.mark.skipif(_cpu.best_isa() != "amx", reason="needs AMX (or the emulated-AMX build)")
@pytest.mark.parametrize("kernel", ["bf16", "i8"])
def test_two_groups_on_each_amx_int4_kernel(tmp_path: Path, kernel: str) -> None:
    """int4 on each AMX kernel whatever HETMOE_AMX_INT4 says here: bf16 tiles exact, int8 tiles
    within the requantization bound."""
    one = _run(1, 40, tmp_path / "one.pt", INT4_CASES, kernel)
    two = _run(2, 40, tmp_path / "two.pt", INT4_CASES, kernel)
    assert one["kernel"] == ("amx", kernel)
    assert _check(one, two, INT4_CASES) == ([] if kernel == "bf16" else ["int4", "int4-odd"])


MAPPED = """
import json, sys, torch
sys.path.insert(0, {here!r})
from moe_oracle import make_experts, write_packed_groups
from hetmoe.experts import CpuMoE
w = make_experts(6, 128, 384, seed=41)
packed = CpuMoE(6, 128, 384, "int8", group_size=128)
packed.load(w.gate, w.up, w.down)
assert packed.num_groups == 2
path = sys.argv[1]
offsets = write_packed_groups(packed, path)
g = torch.Generator().manual_seed(42)
x = torch.randn(40, 128, generator=g)
ids = torch.randint(-1, 6, (40, 4), generator=g)
wts = torch.rand(40, 4, generator=g)
for populate in (False, True):
    mapped = CpuMoE(6, 128, 384, "int8", group_size=128)
    mapped.map_file(path, offsets, populate)  # each group's pages placed by its own workers
    assert all(p.read_only for p in mapped.packed_groups())
    assert torch.equal(mapped.forward(x, ids, wts), packed.forward(x, ids, wts)), populate
print("ok")
"""


def test_a_file_mapped_over_two_groups_equals_the_packed_layer(tmp_path: Path) -> None:
    env = dict(os.environ, HETMOE_NUMA_GROUPS="2", HETMOE_THREADS="2")
    script = MAPPED.format(here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "layer.bin")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
