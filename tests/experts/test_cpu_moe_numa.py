"""NUMA tensor parallelism: two (virtual) groups split the intermediate dim and equal one group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (name, format, hidden, intermediate, group size): int8 with 128-wide groups over 384 = 128 + 256
# columns per NUMA group, which decode computes in 64-column parts.
# Odd sizes (H = 72, I = 200: zero-padded inside) in every format.
CASES = [("bf16", "bf16", 128, 320, None), ("int8", "int8", 128, 320, None),
         ("int4", "int4", 128, 320, None), ("int8-128", "int8", 128, 384, 128),
         ("bf16-odd", "bf16", 72, 200, None), ("int8-odd", "int8", 72, 200, None),
         ("int4-odd", "int4", 72, 200, None)]

SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from moe_oracle import make_experts
from hetmoe.experts import CpuMoE
CASES = {cases!r}
out = {{}}
for name, fmt, hidden, inter, group in CASES:
    w = make_experts(5, hidden, inter, seed=31)
    moe = CpuMoE(5, hidden, inter, fmt, group_size=group, amx_min_tokens=8)
    moe.load(w.gate, w.up, w.down)
    g = torch.Generator().manual_seed(32)
    x = torch.randn({q}, hidden, generator=g)
    ids = torch.randint(-1, 5, ({q}, 4), generator=g)
    out[name] = (moe.num_groups, moe.forward(x, ids, torch.rand({q}, 4, generator=g)))
torch.save(out, sys.argv[1])
"""


def _run(groups: int, q: int, path: Path) -> dict:
    env = dict(os.environ, HETMOE_NUMA_GROUPS=str(groups), HETMOE_THREADS="2")
    script = SCRIPT.format(here=str(Path(__file__).parent), q=q, cases=CASES)
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=120)
    return torch.load(path)


# 3: decode (tokens converted once, groups split); 200: >= 32 rows per expert, the prefill down
# path.
@pytest.mark.parametrize("q", [3, 40, 200])
def test_two_groups_equal_one(tmp_path: Path, q: int) -> None:
    one, two = _run(1, q, tmp_path / "one.pt"), _run(2, q, tmp_path / "two.pt")
    for fmt, *_ in CASES:
        assert one[fmt][0] == 1 and two[fmt][0] == 2
        a, b = one[fmt][1], two[fmt][1]
        # Same packed values and activations; only the fp32 summation order of the halves differs.
        assert float((a - b).norm() / a.norm()) < 1e-6, fmt


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
