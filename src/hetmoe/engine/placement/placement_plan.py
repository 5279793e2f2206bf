"""Which routed experts live on the GPU: the plan under one byte budget, and that budget.

A plan names, per MoE layer, the experts kept resident on the GPU in their packed bytes
(`engine/placement/slots.py` holds them); the CPU computes only the others. Static plans are uniform
by layer (every layer the same count, the leftover bytes one more expert each for the first
layers); within a layer the experts with the most routing counts when counts are given, else the
first ones. `auto_budget` is what a GPU has left for experts after everything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetmoe.engine.placement.staging_plan import StagingPlan, plan_staging

if TYPE_CHECKING:
    from hetmoe.loading.memory_plan import MemoryPlan

GIB = 2**30

GRAPH_RESERVE = GIB // 2
"""GPU bytes `auto` leaves for CUDA graphs' memory pools and torch.compile's workspaces."""

MARGIN_SHARE = 0.05
"""Share of the GPU's memory `auto` leaves unplanned (allocator fragmentation, other users)."""

MIN_MARGIN = GIB
"""At least this many bytes `auto` leaves unplanned."""


@dataclass(frozen=True)
class PlacementPlan:
    """Resident experts per MoE layer under a byte budget."""

    budget: int
    """Bytes the plan may use (after clamping to free memory)."""
    expert_bytes: tuple[int, ...]
    """Packed bytes of one expert per MoE layer (all NUMA groups)."""
    num_experts: tuple[int, ...]
    """Routed experts per MoE layer."""
    resident: tuple[tuple[int, ...], ...]
    """Per MoE layer, the expert ids on the GPU (slot s holds resident[i][s])."""
    staging: StagingPlan | None = None
    """The prefill staging planned beside the resident experts (None: not planned, no GPU)."""

    @property
    def bytes(self) -> int:
        """GPU bytes of the resident experts."""
        return sum(len(r) * b for r, b in zip(self.resident, self.expert_bytes, strict=True))

    @property
    def total_bytes(self) -> int:
        """Packed bytes of every routed expert."""
        return sum(e * b for e, b in zip(self.num_experts, self.expert_bytes, strict=True))

    def slots(self, layer: int) -> int:
        """GPU slots of MoE layer `layer`."""
        return len(self.resident[layer])

    @property
    def everything(self) -> bool:
        """Whether every expert is resident (no CPU work at all)."""
        return all(len(r) == e for r, e in zip(self.resident, self.num_experts, strict=True))

    def gpu_share(self, counts: Sequence[torch.Tensor] | None = None) -> float:
        """Expected share of routed work on the GPU: by `counts` [E] per layer when given,
        else uniform routing (resident / experts)."""
        shares = []
        for i, ids in enumerate(self.resident):
            if counts is None:
                shares.append(len(ids) / self.num_experts[i])
            else:
                c = counts[i].double()
                total = float(c.sum())
                hit = float(c[list(ids)].sum()) if ids else 0.0
                shares.append(hit / total if total else len(ids) / self.num_experts[i])
        return sum(shares) / len(shares) if shares else 0.0

    def describe(self) -> str:
        """One paragraph for `hetmoe info`: bytes, experts per layer, expected GPU share."""
        per_layer = [len(r) for r in self.resident]
        lo, hi = (min(per_layer), max(per_layer)) if per_layer else (0, 0)
        experts = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return (f"GPU experts: {self.bytes / GIB:.2f} GiB of {self.total_bytes / GIB:.2f} GiB "
                f"({self.bytes} of {self.total_bytes} bytes; budget {self.budget} bytes), "
                f"{experts} of {max(self.num_experts, default=0)} experts per MoE layer, "
                f"expected share of routed work on the GPU {self.gpu_share():.1%} "
                "(uniform routing)" + (f"; {self.staging.describe()}" if self.staging else ""))


def plan_placement(num_experts: Sequence[int], expert_bytes: Sequence[int], budget: int,
                   counts: Sequence[torch.Tensor] | None = None) -> PlacementPlan:
    """The static plan of at most `budget` bytes (see the module docstring); `counts` [E] per
    layer ranks each layer's experts (most routed first; ties: lower id)."""
    if len(num_experts) != len(expert_bytes):
        raise ValueError(f"plan_placement: {len(num_experts)} layers' expert counts but "
                         f"{len(expert_bytes)} layers' expert bytes")
    if budget < 0:
        raise ValueError(f"plan_placement: budget must be >= 0 bytes, got {budget}")
    if counts is not None and len(counts) != len(num_experts):
        raise ValueError(f"plan_placement: counts for {len(counts)} layers, the model has "
                         f"{len(num_experts)} MoE layers")
    layers = len(num_experts)
    sizes, left = [0] * layers, budget
    while True:  # rounds of one more expert in every layer that is not full
        growing = [i for i in range(layers) if sizes[i] < num_experts[i]]
        step = sum(expert_bytes[i] for i in growing)
        if not growing or step > left:
            break
        rounds = min(left // step, min(num_experts[i] - sizes[i] for i in growing))
        for i in growing:
            sizes[i] += rounds
        left -= rounds * step
    for i in range(layers):  # leftover bytes: one more expert for the first layers that fit
        if sizes[i] < num_experts[i] and expert_bytes[i] <= left:
            sizes[i] += 1
            left -= expert_bytes[i]
    resident = tuple(_ranked(num_experts[i], None if counts is None else counts[i])[:sizes[i]]
                     for i in range(layers))
    return PlacementPlan(budget, tuple(expert_bytes), tuple(num_experts), resident)


def _ranked(num_experts: int, counts: torch.Tensor | None) -> tuple[int, ...]:
    """Expert ids, most routed first (stable: lower id first among equals)."""
    if counts is None:
        return tuple(range(num_experts))
    if counts.shape != (num_experts,):
        raise ValueError(f"plan_placement: routing counts must be [{num_experts}], found "
                         f"{tuple(counts.shape)}")
    order = torch.sort(counts.cpu().double(), descending=True, stable=True).indices
    return tuple(int(e) for e in order)


def auto_budget(free: int, total: int, prefill_staging: int) -> int:
    """GPU bytes for experts when the budget is `auto`: `free` (measured after the non-expert
    weights and the KV cache are allocated) less the prefill staging, `GRAPH_RESERVE` and a
    margin of max(`MIN_MARGIN`, `MARGIN_SHARE` of `total`)."""
    margin = max(MIN_MARGIN, int(MARGIN_SHARE * total))
    return max(0, free - prefill_staging - GRAPH_RESERVE - margin)


def clamp_budget(asked: int, room: int) -> tuple[int, str]:
    """(bytes used, message): a budget larger than `room` is cut to it, with a message naming
    both (empty when it fits)."""
    if asked <= room:
        return asked, ""
    return room, (f"gpu_expert_bytes={asked} ({asked / GIB:.2f} GiB) exceeds the GPU's room for "
                  f"experts, {room} bytes ({room / GIB:.2f} GiB) after the other weights, the KV "
                  f"cache, graphs, prefill staging and the margin; using {room} bytes")


def planned_placement(mem: MemoryPlan) -> PlacementPlan | None:
    """The `auto` plan of a model before it loads (`hetmoe info MODEL`): the GPU's free bytes
    less the plan's GPU rows, `planned_staging` and `auto_budget`'s reserves, the staging
    beside it; None without a GPU or cpu experts."""
    staging = planned_staging(mem)
    if staging is None:
        return None
    experts = [e for e, _ in mem.expert_layers]
    sizes = [b for _, b in mem.expert_layers]
    plan = plan_placement(experts, sizes, auto_room(mem))
    return PlacementPlan(plan.budget, plan.expert_bytes, plan.num_experts, plan.resident, staging)


def planned_staging(mem: MemoryPlan) -> StagingPlan | None:
    """The prefill staging of the plan `mem` with an `auto` budget (engine/placement/
    staging_plan.py) in the room its GPU rows leave; a staged expert takes its packed bytes
    twice, plus ~3x them as bf16 where prefill unpacks (`MemoryPlan.gpu_unpacks`). None without
    a GPU or cpu experts."""
    if mem.gpu_free is None or not mem.expert_layers:
        return None
    room = auto_budget(mem.gpu_free - mem.total("gpu"), mem.gpu_total, 0)
    staged = max(2 * b + (3 * b if mem.gpu_unpacks else 0) for _, b in mem.expert_layers)
    every = sum(e * b for e, b in mem.expert_layers)
    return plan_staging(max(e for e, _ in mem.expert_layers), staged, room, mem.gpu_total,
                        "auto", every)


def auto_room(mem: MemoryPlan) -> int:
    """GPU bytes `auto` gives experts under the plan `mem` (its GPU rows allocated first):
    `auto_budget` of the free bytes they leave, less `planned_staging`; 0 without a GPU. With no
    KV row in `mem`, the room the KV cache and resident experts share (`hetmoe batch`)."""
    if mem.gpu_free is None:
        return 0
    staging = planned_staging(mem)
    return auto_budget(mem.gpu_free - mem.total("gpu"), mem.gpu_total,
                       staging.bytes if staging is not None else 0)


def slot_table(num_experts: int, experts: Sequence[int]) -> torch.Tensor:
    """[E + 1] int64 on the host: experts[i] -> i, -1 for every other expert and in the last
    entry (so an id of -1 reads -1): a lookup from expert ids to slots of a set of experts."""
    table = torch.full((num_experts + 1,), -1, dtype=torch.int64)
    if experts:
        table[list(experts)] = torch.arange(len(experts))
    return table
