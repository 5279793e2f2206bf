"""`place_experts`: a runner's routed experts made resident on the GPU, and what follows from it.

`ModelRunner.place` runs it between steps: the step launched ahead settled, the old placement
dropped (its graphs, which bake in the CPU jobs, its slots and pool, before the new ones take
memory), the plan under the budget (engine/placement/placement_plan.py, the most routed experts
by `counts` first), fetch-or-compute's staging pool (made only where some work stays on the CPU),
the `Placement` given to the MoE step, the `TrafficPolicy` that moves it toward the routing, and
the prefill planner told of all of it (its costs loaded here, never inside a request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import MoEOverlap
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.placement.placement_fetch import StagingPool, staging_bytes
from hetmoe.engine.placement.placement_plan import PlacementPlan
from hetmoe.engine.placement.placement_policy import TrafficPolicy
from hetmoe.engine.placement.slots import Placement, placement_plan


class PlacingRunner(Protocol):
    """What `place_experts` uses of the `ModelRunner` (engine/executor/runner.py): said here so
    this module does not import the runner, which imports it."""

    device: torch.device
    config: EngineConfig
    max_batch: int
    overlap: MoEOverlap | None
    planner: PrefillPlanner | None
    placement: Placement | None
    policy: TrafficPolicy | None

    @property
    def graphs(self) -> dict[tuple[int, int], Any]: ...

    def settle(self) -> None: ...


def place_experts(runner: PlacingRunner, budget: int | str,
                  counts: Sequence[torch.Tensor] | None, fetch_slots: int | None) -> PlacementPlan:
    """Sets `runner.placement` and `runner.policy` (see `ModelRunner.place`); the plan."""
    overlap, planner, config = runner.overlap, runner.planner, runner.config
    if overlap is None or planner is None:
        raise ValueError("GPU-resident experts need every MoE layer's routed experts in the "
                         "cpu backend")
    runner.settle()
    overlap.place(None)
    planner.place(None)
    runner.placement, runner.policy = None, None  # the old slots (graph pools) go before the new
    runner.graphs.clear()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # so `auto` and the clamp see the memory given back
    slots = config.fetch_slots if fetch_slots is None else fetch_slots
    # fetch-or-compute's pool: room kept in the plan, made (costs loaded) only for CPU work
    plan = placement_plan(overlap.cpu, runner.device, budget, counts,
                          staging_bytes(overlap.cpu, slots))
    pool = StagingPool(overlap.cpu, slots, planner.load_costs(), runner.device) \
        if slots and not plan.everything else None
    if plan.bytes or pool is not None:
        runner.placement = Placement(overlap.cpu, plan, runner.device, overlap.act_quant)
        overlap.place(runner.placement, pool)
        if config.placement_interval and not plan.everything:
            runner.policy = TrafficPolicy(runner.placement, config.placement_interval)
    planner.place(runner.placement)
    planner.prepare(config.prefill_experts, slots, config.stream_decode_rows, runner.max_batch)
    return plan
