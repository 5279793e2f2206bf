"""`Placement`: the routed experts resident on the GPU, per MoE layer, and their slot tables.

Each MoE layer keeps its resident experts in their packed bytes (the CPU backend's layout,
`CpuMoE.packed_groups()`), copied once into one device uint8 tensor per NUMA group
([slots * expert_bytes]), and a slot table on the device, table[e] = e's slot or -1 (one more
entry, -1, so an id of -1 reads -1). A step reads the table on the device: the resident experts
among a token's top-k run on the GPU, the CPU gets only the misses (`LayerSlots.split`; the CPU
backend skips ids < 0). A layer holding every expert holds expert e in slot e: its table is the
identity, so `split` gives the ids themselves as the slots (no gather launch per layer and
step). Routing counts accumulate on the device in the same step. `move` puts another expert into
a slot (a copy on a side stream, then the table entries): only between steps, never while a step
or a captured graph runs. engine/placement/placement_plan.py chooses which experts;
engine/placement/placement_link.py is the MoE step's view of a layer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from hetmoe.engine.placement.placement_compute import packed_slots
from hetmoe.engine.placement.placement_plan import (
    PlacementPlan,
    auto_budget,
    clamp_budget,
    plan_placement,
)
from hetmoe.engine.placement.staging_plan import StagingPlan
from hetmoe.engine.placement.stream_memory import host_groups, stream_staging
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import PackedGroup

log = logging.getLogger(__name__)


class LayerSlots:
    """One MoE layer's resident experts on `device` (see the module docstring); `act_quant`:
    the packed kernel's sorted path on int8 / fp8 tensor cores (`placement_compute`)."""

    def __init__(self, moe: CpuMoE, experts: Sequence[int], device: torch.device,
                 act_quant: bool = False) -> None:
        self.moe, self.device, self.act_quant = moe, device, act_quant
        self.parts = moe.packed_groups()
        self.num_experts = moe.num_experts
        self.expert_bytes = sum(p.expert_bytes for p in self.parts)
        n = len(experts)
        if sorted(experts) == list(range(self.num_experts)):
            experts = range(n)  # every expert: slot e holds e, the table is the identity
        with torch.inference_mode(False):  # written in place between steps, in or out of them
            self.packed = [torch.empty(n * p.expert_bytes, dtype=torch.uint8, device=device)
                           for p in self.parts]
            self.table = torch.full((self.num_experts + 1,), -1, dtype=torch.int64,
                                    device=device)  # [E + 1], last entry -1
            self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            self._one = torch.ones(1, dtype=torch.int64, device=device)  # a count's increment
        self.counting = False
        """Count routing in `split` (two small kernels per layer and step; the traffic policy,
        engine/placement/placement_policy.py, turns it on)."""
        self.resident: list[int] = [-1] * n  # slot -> expert (-1: empty or being filled)
        self.identity = False
        """Whether slot e holds expert e for every e: table[e] = e (set as the table changes)."""
        self._moving: dict[int, tuple[int, torch.cuda.Event | None]] = {}  # slot -> (expert,
        # its copy's event)
        self.host = self._sources()
        """The packed group mappings on the host (pinned on CUDA): where copies come from."""
        for slot, expert in enumerate(experts):
            self.move(slot, expert)

    @property
    def slots(self) -> int:
        """GPU slots of this layer."""
        return len(self.resident)

    @property
    def everything(self) -> bool:
        """Whether every expert of the layer is resident (the CPU has nothing to do)."""
        return self.slots == self.num_experts and -1 not in self.resident

    def experts(self) -> set[int]:
        """The experts in the table now (a slot still being filled holds none)."""
        return {e for e in self.resident if e >= 0}

    def _sources(self) -> list[torch.Tensor]:
        """The group mappings as host tensors (registered for DMA on CUDA)."""
        return host_groups(self.moe, self.device)

    def move(self, slot: int, expert: int, stream: torch.cuda.Stream | None = None) -> None:
        """Puts `expert` into `slot` now (`begin_move`, then `end_moves` waiting for the copy).
        Only between steps."""
        self.begin_move(slot, expert, stream)
        self.end_moves(wait=True)

    def begin_move(self, slot: int, expert: int, stream: torch.cuda.Stream | None = None) -> None:
        """Starts putting `expert` into `slot`: the slot's expert leaves the table at once (the
        CPU computes it from the next step on), the bytes are copied on `stream` (CUDA; after
        the steps already queued) and `end_moves` enters the new expert once they are there.
        Steps queued on the current stream before it keep reading the old table and bytes."""
        if not 0 <= slot < self.slots or not 0 <= expert < self.num_experts:
            raise ValueError(f"LayerSlots.move: slot {slot} of {self.slots}, expert {expert} "
                             f"of {self.num_experts}")
        if expert in self.resident and self.resident.index(expert) != slot:
            raise ValueError(f"LayerSlots.move: expert {expert} already has slot "
                             f"{self.resident.index(expert)}")
        if slot in self._moving:
            raise ValueError(f"LayerSlots.move: slot {slot} is still being filled")
        with torch.inference_mode(False):
            old = self.resident[slot]
            if old >= 0:
                self.table[old] = -1
            self.resident[slot] = -1
            copy = torch.cuda.stream(stream) if stream is not None else nullcontext()
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with copy:
                copy_expert(self.packed, slot, self.host, expert, self.parts)
            done = None
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
        self._moving[slot] = (expert, done)
        self.identity = False  # the slot's expert left the table

    def arriving(self) -> set[int]:
        """Experts whose copies into a slot are under way."""
        return {expert for expert, _ in self._moving.values()}

    def end_moves(self, wait: bool = False) -> int:
        """Enters the experts whose copies are done (all of them with `wait`) into the table;
        how many are still being copied."""
        with torch.inference_mode(False):
            for slot, (expert, done) in list(self._moving.items()):
                if done is not None and not done.query():
                    if not wait:
                        continue
                    torch.cuda.current_stream(self.device).wait_event(done)
                self.table[expert] = slot
                self.resident[slot] = expert
                del self._moving[slot]
        self.identity = self.resident == list(range(self.num_experts))
        return len(self._moving)

    def split(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [T, K] expert ids (>= 0, as routers give them) -> (slots [T, K]: the GPU's, -1
        elsewhere; the CPU's expert ids [T, K], -1 where resident, None when every expert is
        resident); with `counting`, adds the routing to `counts` on the device. With the
        `identity` table the slots are `ids` itself (ids of -1 too: the table's last entry)."""
        if self.counting:
            with torch.inference_mode(False):
                self.counts.index_add_(0, ids.reshape(-1), self._one.expand(ids.numel()))
        slot = ids if self.identity else self.table[ids]
        return slot, None if self.everything else torch.where(slot < 0, ids, -1)

    def compute(self, x: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert ids and their slots [T, K] (-1: not here), weights [T, K] ->
        [T, H] fp32 of the resident experts' pairs."""
        return packed_slots(x, ids, slot, weights, self.packed, self.parts,
                            self.moe.weight_format, self.moe.hidden, self.moe.group_size,
                            self.table[:-1], self.act_quant)


def copy_expert(dst: Sequence[torch.Tensor], slot: int, src: Sequence[torch.Tensor],
                expert: int, parts: Sequence[PackedGroup]) -> None:
    """Copies `expert`'s packed bytes (every NUMA group of `src`, the host mappings) into `slot`
    of `dst` (one GPU tensor per group, slots back to back), on the current stream."""
    for d, s, part in zip(dst, src, parts, strict=True):
        b = part.expert_bytes
        d[slot * b:(slot + 1) * b].copy_(s[expert * b:(expert + 1) * b], non_blocking=True)


class Placement:
    """Every MoE layer's `LayerSlots` under one plan (`act_quant`: theirs)."""

    def __init__(self, cpu: Sequence[CpuMoE], plan: PlacementPlan, device: torch.device,
                 act_quant: bool = False) -> None:
        if len(cpu) != len(plan.resident):
            raise ValueError(f"Placement: a plan of {len(plan.resident)} MoE layers for a model "
                             f"of {len(cpu)}")
        self.plan, self.device = plan, device
        self.layers = [LayerSlots(m, ids, device, act_quant)
                       for m, ids in zip(cpu, plan.resident, strict=True)]

    @property
    def everything(self) -> bool:
        """Whether every expert of every layer is resident."""
        return all(layer.everything for layer in self.layers)

    def counts(self) -> list[torch.Tensor]:
        """Routing counts [E] per layer since the start (or the last `reset_counts`)."""
        return [layer.counts.cpu() for layer in self.layers]

    def reset_counts(self) -> None:
        """Zeroes the routing counts."""
        with torch.inference_mode(False):
            for layer in self.layers:
                layer.counts.zero_()


def expert_bytes(cpu: Sequence[CpuMoE]) -> list[int]:
    """Packed bytes of one expert per layer (all NUMA groups)."""
    return [sum(p.expert_bytes for p in m.packed_groups()) for m in cpu]


def gpu_room(cpu: Sequence[CpuMoE], device: torch.device, reserved: int = 0,
             asked: int | str = "auto") -> tuple[int, StagingPlan | None]:
    """(what `auto` may give resident experts on `device` now, the prefill staging beside them
    for the budget `asked`): placement_plan.auto_budget, less `reserved` bytes that are not
    allocated yet, less the staging (engine/placement/staging_plan.py); (0, None) without a GPU."""
    if device.type != "cuda":
        return 0, None
    free, total = torch.cuda.mem_get_info(device)
    room = auto_budget(int(free) - reserved, int(total), 0)
    staging = stream_staging(cpu, device, room, int(total), asked)
    return max(0, room - staging.bytes), staging


def placement_plan(cpu: Sequence[CpuMoE], device: torch.device, asked: int | str,
                   counts: Sequence[torch.Tensor] | None = None,
                   reserved: int = 0) -> PlacementPlan:
    """The plan for `EngineConfig.gpu_expert_bytes` = `asked` ("auto" or bytes), with the
    prefill staging beside it (`gpu_room`): auto takes the GPU's room (none without a GPU) less
    `reserved` bytes to be allocated after the plan (the fetch pool); bytes beyond the room are
    clamped with a warning naming both (on the CPU device the "GPU" is host memory: not
    clamped)."""
    if not (asked == "auto" or (isinstance(asked, int) and asked >= 0)):
        raise ValueError(f"gpu_expert_bytes must be 'auto' or an integer >= 0, got {asked!r}")
    room, staging = gpu_room(cpu, device, reserved, asked)
    budget = room if asked == "auto" else int(asked)
    if device.type == "cuda" and asked != "auto":
        budget, message = clamp_budget(int(asked), room)
        if message:
            log.warning("%s", message)
    plan = plan_placement([m.num_experts for m in cpu], expert_bytes(cpu), budget, counts)
    return dataclasses.replace(plan, staging=staging)
