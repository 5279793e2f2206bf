"""The prefill staging cap (engine/placement/staging_plan.py) and the room it leaves resident
experts: a whole layer where it fits STAGING_SHARE of the card (Qwen3-30B-A3B on any card, a
DeepSeek-V3 layer on 80 GB), a bounded k where it does not (DeepSeek-V3 on 24 GB), nothing when
every expert is resident; explicit budgets leave staging the rest; bad input named."""

from __future__ import annotations

import pytest

from hetmoe.engine.placement.placement_plan import (
    auto_budget,
    clamp_budget,
    planned_placement,
    planned_staging,
)
from hetmoe.engine.placement.staging_plan import STAGING_SHARE, plan_staging, streamer_cap
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.loading.memory_plan import MemoryPlan

GIB = 2**30
H100 = 85_520_809_984  # torch.cuda.mem_get_info's total on an H100 80 GB (81,559 MiB)
RTX_24 = 25_757_220_864  # a 24 GB card (24,564 MiB)


def expert(experts: int, hidden: int, width: int) -> int:
    """Packed INT8 bytes of one expert (all NUMA groups), as `memory_plan` counts them."""
    moe = CpuMoE(experts, hidden, width, weight_format="int8")
    return sum(p.expert_bytes for p in moe.packed_groups())


DEEPSEEK = expert(256, 7168, 2048)  # 46.8 MB: a layer is 12.0 GB
QWEN3 = expert(128, 2048, 768)  # 5.0 MB: a layer is 0.64 GB


def gpu(total: int, other: int, layers: tuple[tuple[int, int], ...],
        unpacks: bool = False) -> MemoryPlan:
    """A plan on a fresh card of `total` bytes: `other` GPU bytes (weights and KV cache)."""
    rows = (("routed experts", "host", sum(e * b for e, b in layers)),
            ("other weights", "gpu", other))
    return MemoryPlan(rows, 2**40, total, layers, total, unpacks)


def test_deepseek_v3_on_80_gb_streams_a_whole_layer_and_leaves_residents_room() -> None:
    mem = gpu(H100, 30 * GIB, ((256, DEEPSEEK),) * 58)  # 58 MoE layers, 30 GiB of the rest
    staging = planned_staging(mem)
    assert staging is not None and staging.whole
    assert staging.bytes == 2 * 256 * DEEPSEEK <= STAGING_SHARE * H100  # no bf16 copy
    plan = planned_placement(mem)
    assert plan is not None
    room = auto_budget(H100 - 30 * GIB, H100, staging.bytes)
    assert plan.budget == room > 20 * GIB
    assert "256 of 256 experts per layer" in plan.describe()
    # The few-layers shape (3 MoE layers, 36 GB of experts) at the bench's 8 GB budget: was
    # clamped to 0.76 GiB (two layers and one unpacked reserved); now a whole layer streams and
    # the budget fits.
    few = gpu(H100, 6 * GIB, ((256, DEEPSEEK),) * 3)
    room = auto_budget(H100 - 6 * GIB, H100, 0)
    bench = plan_staging(256, 2 * DEEPSEEK, room, H100, 8_000_000_000, 3 * 256 * DEEPSEEK)
    assert bench.whole and clamp_budget(8_000_000_000, room - bench.bytes)[1] == ""
    auto = planned_placement(few)  # auto: every expert fits beside the rest, nothing staged
    assert auto is not None and auto.everything and auto.staging is not None
    assert auto.staging.experts == 0
    # Where prefill unpacks, each staged expert also takes its bf16 copy: the cap binds.
    unpacking = planned_staging(gpu(H100, 30 * GIB, ((256, DEEPSEEK),) * 58, unpacks=True))
    assert unpacking is not None and unpacking.expert_bytes == 5 * DEEPSEEK
    assert unpacking.experts == int(STAGING_SHARE * H100) // (5 * DEEPSEEK) == 109


def test_deepseek_v3_on_24_gb_stages_a_bounded_k_and_residents_get_the_rest() -> None:
    mem = gpu(RTX_24, 6 * GIB, ((256, DEEPSEEK),) * 58)  # full DeepSeek-V3: 58 MoE layers
    staging = planned_staging(mem)
    assert staging is not None and not staging.whole
    assert staging.experts == int(STAGING_SHARE * RTX_24) // (2 * DEEPSEEK) == 82
    plan = planned_placement(mem)
    assert plan is not None and plan.staging == staging
    room = auto_budget(RTX_24 - 6 * GIB, RTX_24, 0)
    assert plan.budget == room - staging.bytes > 7 * GIB
    assert plan.describe().endswith(
        f"prefill staging: 82 of 256 experts per layer, {staging.bytes / GIB:.2f} GiB "
        f"({staging.bytes} bytes; {2 * DEEPSEEK} per expert); a pass streams at most 82 misses "
        "per layer (the CPU computes the other misses)")


def test_qwen3_30b_a3b_streams_whole_layers_as_before() -> None:
    layers = ((128, QWEN3),) * 48
    every = 48 * 128 * QWEN3  # 30.8 GB
    staging = planned_staging(gpu(RTX_24, 3 * GIB, layers))
    assert staging is not None and staging.whole and staging.bytes == 2 * 128 * QWEN3
    plan = planned_placement(gpu(RTX_24, 3 * GIB, layers))
    assert plan is not None
    assert plan.budget == auto_budget(RTX_24 - 3 * GIB, RTX_24, 2 * 128 * QWEN3)
    # On 80 GB: every expert resident under auto (as before); the sweep's budgets stream whole.
    room = auto_budget(H100 - 3 * GIB, H100, 0)
    assert plan_staging(128, 2 * QWEN3, room, H100, "auto", every).experts == 0
    for budget in (0, 8 * 10**9, 15 * 10**9, 23 * 10**9):
        assert plan_staging(128, 2 * QWEN3, room, H100, budget, every).whole


def test_every_expert_resident_stages_nothing() -> None:
    staging = planned_staging(gpu(H100, 3 * GIB, ((128, QWEN3),) * 48))  # 30.8 GB of experts
    assert staging is not None and staging.experts == 0 and staging.bytes == 0
    assert staging.describe() == "prefill staging: none (every routed expert is resident)"
    plan = planned_placement(gpu(H100, 3 * GIB, ((128, QWEN3),) * 48))
    assert plan is not None and plan.everything


def test_an_explicit_budget_leaves_staging_the_rest_up_to_a_whole_layer() -> None:
    per, room = 2 * DEEPSEEK, 14 * GIB
    share = int(STAGING_SHARE * RTX_24) // per
    assert plan_staging(256, per, room, RTX_24).experts == share  # auto
    assert plan_staging(256, per, room, RTX_24, 0).experts == room // per  # budget 0: the room
    assert plan_staging(256, per, room, RTX_24, 2 * GIB).experts == (room - 2 * GIB) // per
    assert plan_staging(256, per, room, RTX_24, 12 * GIB).experts == share  # at least its share
    assert plan_staging(256, per, 100 * GIB, H100, 0).experts == 256  # never more than a layer
    assert plan_staging(256, per, room, RTX_24, 10**13, 10**12).experts == share


def test_no_room_and_bad_input_are_named() -> None:
    none = plan_staging(256, 2 * DEEPSEEK, 2 * DEEPSEEK - 1, RTX_24)
    assert (none.experts, none.why) == (0, f"{2 * DEEPSEEK - 1} bytes of room for experts, one "
                                           f"staged expert takes {2 * DEEPSEEK}")
    with pytest.raises(ValueError, match="layers of 0 experts of 10 bytes; both must be > 0"):
        plan_staging(0, 10, GIB, RTX_24)
    with pytest.raises(ValueError, match="asked must be 'auto' or bytes, got 'lots'"):
        plan_staging(8, 10, GIB, RTX_24, "lots")


def test_a_streamer_takes_the_planned_cap_while_free_memory_holds_it() -> None:
    assert streamer_cap(82, 256, 100, free=10_000, room=5_000) == 82
    assert streamer_cap(82, 256, 100, free=5_000, room=2_000) == 50  # something took memory
    assert streamer_cap(None, 256, 100, free=50_000, room=30_000) == 256  # budget 0: a layer
    assert streamer_cap(None, 256, 100, free=10_000, room=5_000) == 50  # ... within the room
    assert streamer_cap(None, 256, 100, free=10_000, room=-5) == 0
