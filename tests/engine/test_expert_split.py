"""Where a GPU prefill layer's experts run (engine/expert_split.py) and the GPU side's compute
of a subset of experts (`routed_mlp(local=...)`), on the CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.expert_split import (
    SplitCosts,
    measure_cpu_costs,
    plan_split,
    prefer_split,
    split_seconds,
)
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.routed_mlp import routed_mlp

COSTS = SplitCosts(cpu_fixed=50e-6, cpu_token=2.7e-6, gpu_expert=93e-6)


def brute_force(counts: torch.Tensor, costs: SplitCosts) -> float:
    """The best max(CPU, GPU) over every assignment of the active experts."""
    active = [e for e in range(len(counts)) if counts[e] > 0]
    best = float("inf")
    for sides in itertools.product((False, True), repeat=len(active)):
        cpu = sum(costs.cpu_fixed + costs.cpu_token * float(counts[e])
                  for e, g in zip(active, sides, strict=True) if not g)
        gpu = sum(costs.gpu_expert + costs.gpu_token * float(counts[e])
                  for e, g in zip(active, sides, strict=True) if g)
        best = min(best, max(cpu, gpu))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_near_the_best_assignment(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 60, (10,), generator=g) * (torch.rand(10, generator=g) > 0.2)
    costs = SplitCosts(40e-6, 3e-6, 90e-6, 0.1e-6)
    on_gpu = plan_split(counts, costs)
    assert on_gpu.dtype == torch.bool and on_gpu.shape == (10,)
    assert not on_gpu[counts == 0].any()  # an expert no token chose is not copied
    best = brute_force(counts, costs)
    # Lightest-first prefixes are optimal up to one expert's cost (the assignment is a
    # partition problem; the prefix rule keeps the light experts where weights are cheap).
    assert split_seconds(counts, costs) <= best + costs.cpu_fixed + 60 * costs.cpu_token


def test_light_experts_go_to_the_cpu_heavy_ones_to_the_gpu() -> None:
    counts = torch.tensor([1, 400, 2, 300, 0, 3, 500, 1])
    on_gpu = plan_split(counts, COSTS)
    assert on_gpu.tolist() == [False, True, False, True, False, False, True, False]


def test_all_on_one_side_when_the_other_is_far_slower() -> None:
    counts = torch.tensor([5, 7, 9, 0])
    assert not plan_split(counts, SplitCosts(1e-6, 0.0, 1.0)).any()  # GPU copy far too slow
    assert plan_split(counts, SplitCosts(1.0, 1.0, 1e-6)).tolist() == [True, True, True, False]
    assert not plan_split(torch.zeros(4, dtype=torch.int64), COSTS).any()


def test_short_prompts_split_long_ones_stream() -> None:
    # Qwen3-30B-A3B-like: 128 experts, top 8; CPU cost grows with tokens, the copy does not.
    assert prefer_split(512, 8, 128, COSTS)
    assert prefer_split(128, 8, 128, COSTS)
    assert not prefer_split(16384, 8, 128, COSTS)


def test_measured_cpu_costs_are_positive_and_grow_with_tokens() -> None:
    moe = CpuMoE(8, 64, 96, "int8")
    g = torch.Generator().manual_seed(0)
    moe.load(torch.randn(8, 96, 64, generator=g) * 0.1, torch.randn(8, 96, 64, generator=g) * 0.1,
             torch.randn(8, 64, 96, generator=g) * 0.1)
    fixed, token = measure_cpu_costs(moe, experts=4, small=2, large=64, repeats=2)
    assert fixed >= 0 and token >= 0 and fixed + token > 0


@pytest.mark.parametrize("hidden", [64, 40])
def test_routed_mlp_on_a_subset_of_experts_adds_up_to_all(hidden: int) -> None:
    g = torch.Generator().manual_seed(3)
    e, s, t, k = 6, 32, 13, 3
    hp = 64
    gate_up = (torch.randn(e, 2 * s, hp, generator=g) * 0.2).to(torch.bfloat16)
    gate_up[:, :, hidden:] = 0
    down = (torch.randn(e, 64, s, generator=g) * 0.2).to(torch.bfloat16)
    down[:, hidden:] = 0
    x = torch.randn(t, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    full = routed_mlp(x, ids, w, [(gate_up, down)], grouped=False)
    here = torch.tensor([0, 2, 5])
    rest = torch.tensor([1, 3, 4])
    parts = []
    for chosen in (here, rest):
        local = torch.full((e,), -1, dtype=torch.int64)
        local[chosen] = torch.arange(len(chosen))
        parts.append(routed_mlp(x, ids, w, [(gate_up[chosen], down[chosen])], grouped=False,
                                local=local))
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)
    nowhere = torch.full((e,), -1, dtype=torch.int64)
    assert routed_mlp(x, ids, w, [(gate_up[:1], down[:1])], False, nowhere).abs().max() == 0


def test_prefill_split_option_is_checked() -> None:
    assert EngineConfig(prefill_split=True).prefill_split is True
    with pytest.raises(ValueError, match="prefill_split must be None"):
        EngineConfig(prefill_split="yes")  # type: ignore[arg-type]
