"""NUMA tensor parallelism: two (virtual) groups split the intermediate dim and equal one group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = """
import sys, torch
sys.path.insert(0, {here!r})
from moe_oracle import make_experts
from hetmoe.experts import CpuMoE
out = {{}}
for fmt in ("bf16", "int8", "int4"):
    w = make_experts(5, 128, 320, seed=31)
    moe = CpuMoE(5, 128, 320, fmt, amx_min_tokens=8)
    moe.load(w.gate, w.up, w.down)
    g = torch.Generator().manual_seed(32)
    x = torch.randn({q}, 128, generator=g)
    ids = torch.randint(-1, 5, ({q}, 4), generator=g)
    out[fmt] = (moe.num_groups, moe.forward(x, ids, torch.rand({q}, 4, generator=g)))
torch.save(out, sys.argv[1])
"""


def _run(groups: int, q: int, path: Path) -> dict:
    env = dict(os.environ, HETMOE_NUMA_GROUPS=str(groups), HETMOE_THREADS="2")
    script = SCRIPT.format(here=str(Path(__file__).parent), q=q)
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=120)
    return torch.load(path)


@pytest.mark.parametrize("q", [40, 200])  # 200: >= 32 rows per expert, the prefill down path
def test_two_groups_equal_one(tmp_path: Path, q: int) -> None:
    one, two = _run(1, q, tmp_path / "one.pt"), _run(2, q, tmp_path / "two.pt")
    for fmt in ("bf16", "int8", "int4"):
        assert one[fmt][0] == 1 and two[fmt][0] == 2
        a, b = one[fmt][1], two[fmt][1]
        # Same packed values and activations; only the fp32 summation order of the halves differs.
        assert float((a - b).norm() / a.norm()) < 1e-6, fmt
