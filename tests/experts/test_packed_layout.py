"""The packed layout read back in torch (GPU prefill's view of the CPU backend's one copy) and the
routed MLP computed on it, against the float64 oracle: odd sizes, formats, 1 and 2 NUMA groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_oracle import make_experts, rel_error

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor, unpack_group, unpack_matrix
from hetmoe.experts.routed_mlp import routed_mlp


def host_bytes(moe: CpuMoE) -> list[torch.Tensor]:
    """Each group's mapping as a uint8 tensor [E, expert_bytes] (shares the memory)."""
    return [host_tensor(part).view(-1, part.expert_bytes) for part in moe.packed_groups()]


@pytest.mark.parametrize(("fmt", "hidden", "inter", "group"), [
    ("bf16", 96, 160, None), ("bf16", 64, 32, None), ("int8", 96, 160, None),
    ("int8", 128, 384, 128), ("int8", 64, 96, 32), ("bf16", 40, 48, None), ("int8", 72, 200, None),
    ("int8", 100, 48, 64)])
def test_unpacked_weights_equal_the_loaded_ones(fmt: str, hidden: int, inter: int,
                                                group: int | None) -> None:
    w = make_experts(3, hidden, inter, seed=hidden + inter)
    moe = CpuMoE(3, hidden, inter, fmt, group_size=group)
    moe.load(w.gate, w.up, w.down)
    (part,), (raw,) = moe.packed_groups(), host_bytes(moe)
    gate_up, down = unpack_group(raw, part, fmt, hidden, moe.group_size)
    s = part.end - part.begin
    hp, hn = gate_up.shape[2], -(-hidden // 16) * 16
    assert gate_up.shape == (3, 2 * s, hp) and down.shape == (3, hn, s) and hp % 64 == 0
    pairs = [(gate_up[:, :inter, :hidden], w.gate), (gate_up[:, s:s + inter, :hidden], w.up),
             (down[:, :hidden, :inter], w.down)]
    for got, want in pairs:
        if fmt == "bf16":
            assert torch.equal(got, want.to(torch.bfloat16))
        else:  # symmetric absmax int8 per (row, group): |error| <= half a step, then bf16
            g, cols = moe.group_size, want.shape[-1]
            padded = torch.nn.functional.pad(want, (0, -cols % g))  # groups of the padded dims
            step = padded.unflatten(-1, (-1, g)).abs().amax(-1, keepdim=True) / 127
            bound = (step / 2 * 1.001).expand(*step.shape[:-1], g).flatten(-2)[..., :cols]
            assert ((got.float() - want).abs() <= bound + want.abs() / 128).all()
    # Padding rows and columns are zero weights.
    assert not gate_up[:, inter:s].any() and not gate_up[:, s + inter:].any()
    assert not gate_up[:, :, hidden:].any() and not down[:, :, inter:].any()
    assert not down[:, hidden:].any()


def test_unpack_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="format 'fp4' is not unpacked here"):
        unpack_matrix(torch.zeros(1, 1024, dtype=torch.uint8), "fp4", 16, 64, 32)


@pytest.mark.parametrize(("hidden", "inter", "group"),
                         [(96, 160, None), (128, 384, 128), (128, 256, 64), (64, 96, 32),
                          (40, 48, None), (100, 200, 32)])
def test_int4_unpacked_equals_what_the_cpu_kernels_compute(hidden: int, inter: int,
                                                           group: int | None) -> None:
    """Int4 is asymmetric with a least-squares fit, so the weights are not recovered exactly:
    the MLP on the unpacked weights must match the CPU backend on the same packed bytes (which
    also quantizes its activations to u8) and be as close to the float64 oracle as it is."""
    w = make_experts(5, hidden, inter, seed=3)
    moe = CpuMoE(5, hidden, inter, "int4", group_size=group)
    moe.load(w.gate, w.up, w.down)
    parts = [unpack_group(raw, part, "int4", hidden, moe.group_size)
             for part, raw in zip(moe.packed_groups(), host_bytes(moe), strict=True)]
    gate_up, down = parts[0]
    s = moe.packed_groups()[0].end - moe.packed_groups()[0].begin
    for got, want in ((gate_up[:, :inter, :hidden], w.gate), (gate_up[:, s:s + inter, :hidden],
                      w.up), (down[:, :hidden, :inter], w.down)):
        assert rel_error(got, want.double()) < 0.1  # int4 at these groups: 0.07-0.095
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, hidden, generator=g)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(20)])
    weights = torch.rand(20, 3, generator=g)
    ref = w.reference(x, ids, weights)
    out, cpu = routed_mlp(x, ids, weights, parts, grouped=False), moe.forward(x, ids, weights)
    assert rel_error(out, cpu.double()) < 0.06
    assert rel_error(out, ref) <= 1.05 * rel_error(cpu, ref)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize(("hidden", "inter"), [(96, 160), (40, 48), (100, 200)])
def test_routed_mlp_on_unpacked_weights_equals_the_oracle(fmt: str, tokens: int, hidden: int,
                                                          inter: int) -> None:
    w = make_experts(5, hidden, inter, seed=tokens)
    moe = CpuMoE(5, hidden, inter, fmt)
    moe.load(w.gate, w.up, w.down)
    parts = [unpack_group(raw, part, fmt, hidden, moe.group_size)
             for part, raw in zip(moe.packed_groups(), host_bytes(moe), strict=True)]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(tokens)])
    weights = torch.rand(tokens, 3, generator=g)
    out = routed_mlp(x, ids, weights, parts, grouped=False)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, w.reference(x, ids, weights)) < (0.01 if fmt == "bf16" else 0.03)


SCRIPT = """
import json, sys, torch
sys.path[:0] = [{here!r}]
from test_packed_layout import host_bytes
from moe_oracle import make_experts, rel_error
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import unpack_group
from hetmoe.experts.routed_mlp import routed_mlp
w = make_experts(4, 128, 384, seed=5)
moe = CpuMoE(4, 128, 384, "int8", group_size=128)
moe.load(w.gate, w.up, w.down)
parts = [unpack_group(raw, p, "int8", 128, 128) for p, raw in zip(moe.packed_groups(),
         host_bytes(moe), strict=True)]
g = torch.Generator().manual_seed(6)
x, ids = torch.randn(9, 128, generator=g), torch.randint(0, 4, (9, 2), generator=g)
weights = torch.rand(9, 2, generator=g)
err = rel_error(routed_mlp(x, ids, weights, parts, grouped=False), w.reference(x, ids, weights))
print(json.dumps([moe.num_groups, [[p.begin, p.end] for p in moe.packed_groups()], err]))
"""


def test_two_numa_groups_sum_their_slices() -> None:
    env = dict(os.environ, HETMOE_NUMA_GROUPS="2", HETMOE_THREADS="2")
    script = SCRIPT.format(here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120,
                          capture_output=True, text=True)
    groups, slices, err = json.loads(done.stdout)
    assert groups == 2 and slices == [[0, 128], [128, 384]] and err < 0.03
