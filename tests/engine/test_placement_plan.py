"""The placement planner: within its budget, uniform by layer, ranked by counts, clamped."""

from __future__ import annotations

import pytest
import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.placement.placement_plan import (
    GIB,
    auto_budget,
    clamp_budget,
    plan_placement,
)


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_never_exceeds_its_budget_and_fills_it_uniformly(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    layers = int(torch.randint(1, 6, (), generator=g))
    experts = [int(torch.randint(1, 20, (), generator=g)) for _ in range(layers)]
    sizes = [int(torch.randint(100, 1000, (), generator=g)) for _ in range(layers)]
    total = sum(e * b for e, b in zip(experts, sizes, strict=True))
    budget = int(torch.randint(0, total + 2000, (), generator=g))
    plan = plan_placement(experts, sizes, budget)
    assert plan.bytes <= budget
    counts = [len(r) for r in plan.resident]
    assert all(c <= e for c, e in zip(counts, experts, strict=True))
    # Uniform: no layer short of another by more than one expert unless it is full.
    top = max(counts)
    assert all(c >= top - 1 or c == e for c, e in zip(counts, experts, strict=True))
    # Nothing more fits: every layer below the top that is not full has an expert larger than
    # what is left.
    left = budget - plan.bytes
    assert all(c == e or c == top or b > left
               for c, e, b in zip(counts, experts, sizes, strict=True))
    assert all(r == tuple(range(len(r))) for r in plan.resident)  # no counts: the first ones


def test_budget_zero_places_nothing_and_a_large_one_everything() -> None:
    none = plan_placement([8, 8], [100, 100], 0)
    assert none.resident == ((), ()) and none.bytes == 0 and not none.everything
    assert none.gpu_share() == 0.0
    every = plan_placement([8, 8], [100, 100], 10**9)
    assert every.everything and every.bytes == every.total_bytes == 1600
    assert every.gpu_share() == 1.0


def test_counts_choose_the_most_routed_experts() -> None:
    counts = [torch.tensor([1, 9, 0, 5]), torch.tensor([3, 3, 7, 0])]
    plan = plan_placement([4, 4], [10, 10], 40, counts)
    assert plan.resident == ((1, 3), (2, 0))  # ties: the lower id first
    assert plan.gpu_share(counts) == pytest.approx((14 / 15 + 10 / 13) / 2)
    assert plan.gpu_share() == 0.5


def test_leftover_bytes_give_the_first_layers_one_more_expert() -> None:
    plan = plan_placement([4, 4, 4], [10, 10, 10], 50)
    assert [len(r) for r in plan.resident] == [2, 2, 1]
    assert "1-2 of 4 experts per MoE layer" in plan.describe()
    assert "(50 of 120 bytes; budget 50 bytes)" in plan.describe()


def test_bad_plans_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="budget must be >= 0 bytes, got -1"):
        plan_placement([4], [10], -1)
    with pytest.raises(ValueError, match="2 layers' expert counts but 1 layers' expert bytes"):
        plan_placement([4, 4], [10], 10)
    with pytest.raises(ValueError, match=r"routing counts must be \[4\], found \(3,\)"):
        plan_placement([4], [10], 10, [torch.zeros(3)])
    with pytest.raises(ValueError, match="option gpu_expert_bytes must be 'auto' or an integer "
                       ">= 0, got -5"):
        EngineConfig(gpu_expert_bytes=-5)
    with pytest.raises(ValueError, match="got 'lots'"):
        EngineConfig(gpu_expert_bytes="lots")


def test_auto_leaves_staging_graphs_and_a_margin_and_clamping_names_the_bytes() -> None:
    total = 80 * GIB
    free = 60 * GIB
    # margin: 5 % of 80 GiB = 4 GiB; graphs 0.5 GiB; staging 3 GiB
    assert auto_budget(free, total, 3 * GIB) == free - 3 * GIB - GIB // 2 - 4 * GIB
    assert auto_budget(GIB, total, 3 * GIB) == 0
    assert auto_budget(10 * GIB, 16 * GIB, 0) == 10 * GIB - GIB // 2 - GIB  # the 1 GiB floor
    used, message = clamp_budget(100, 40)
    assert used == 40
    assert message.startswith("gpu_expert_bytes=100 (0.00 GiB) exceeds the GPU's room for "
                              "experts, 40 bytes (0.00 GiB)")
    assert clamp_budget(40, 100) == (40, "")


def test_the_cli_option_reads_gib_or_auto(capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    from hetmoe.cli_engine import gpu_expert_bytes

    assert gpu_expert_bytes("auto") == "auto"
    assert gpu_expert_bytes("1.5") == 3 * GIB // 2
    assert gpu_expert_bytes("0") == 0
    for bad in ("-1", "lots"):
        with pytest.raises(typer.Exit):
            gpu_expert_bytes(bad)
        assert f"error: --gpu-expert-gib takes auto or GiB >= 0, got '{bad}'" in \
            capsys.readouterr().err


def test_info_plans_auto_from_the_memory_plan() -> None:
    from hetmoe.engine.placement.placement_plan import planned_placement
    from hetmoe.loading.memory_plan import MemoryPlan

    rows = (("other weights", "gpu", 2 * GIB), ("KV cache", "gpu", GIB))
    layers = ((128, 6 * 2**20),) * 48  # 48 layers of 128 experts of 6 MiB: 36 GiB
    mem = MemoryPlan(rows, 100 * GIB, 23 * GIB, layers, 24 * GIB)
    plan = planned_placement(mem)
    assert plan is not None
    # 23 - 3 GiB free after the rest, less staging (2 x 0.75 GiB: the packed kernels need no
    # bf16 copy), graphs and 1.2 GiB
    room = 20 * GIB - 3 * GIB // 2 - GIB // 2 - int(0.05 * 24 * GIB)
    assert plan.budget == room and plan.bytes <= room
    uniform = room // (48 * 6 * 2**20)  # 59 in every layer, the leftover: one more in some
    assert uniform == 59 and {len(r) for r in plan.resident} == {59, 60}
    assert "59-60 of 128 experts per MoE layer" in plan.describe()
    assert plan.staging is not None and plan.staging.whole
    assert plan.describe().endswith(
        f"; prefill staging: 128 of 128 experts per layer, 1.50 GiB ({3 * GIB // 2} bytes; "
        f"{12 * 2**20} per expert); a pass streams at most 128 misses per layer (a whole layer)")
    assert planned_placement(MemoryPlan(rows, 100 * GIB, None, layers)) is None
