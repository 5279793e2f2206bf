"""`StagingPool`: a few GPU slots that a step's heavy CPU misses are copied into and computed from.

Fetch-or-compute (engine/placement/fetch_plan.py says which misses): a layer's step reads its
misses' ids on the host (one sync; the CPU link is handed those host ids, so they cross once),
plans, copies the chosen experts' packed bytes from the same pinned host mappings the placement
copies from (`placement.copy_expert`) into the pool's slots on a copy stream, and computes them
with the resident experts' kernel (`placement_compute.packed_slots`) once the copies are there;
the CPU gets the other misses only. One pool serves every layer (layers run one after another): a
layer's copies wait until the previous layer's fetched compute is done.

Only outside CUDA graphs: the plan needs the ids on the host, which a captured step never has.
A step of fewer tokens than `fetch_plan.least_tokens` (decode at batch 1, small batches) cannot
fetch anything that pays, so it plans nothing and adds no sync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hetmoe.engine.placement.expert_split import SplitCosts
from hetmoe.engine.placement.fetch_plan import least_tokens, plan_fetch
from hetmoe.engine.placement.placement_compute import capturing, packed_slots
from hetmoe.engine.placement.placement_plan import slot_table
from hetmoe.engine.placement.slots import LayerSlots, copy_expert
from hetmoe.experts.cpu_moe import CpuMoE

log = logging.getLogger(__name__)


def slot_widths(cpu: Sequence[CpuMoE]) -> list[int]:
    """Bytes of one pool slot per NUMA group: the widest expert of any layer of `cpu`."""
    groups = {len(m.packed_groups()) for m in cpu}
    if len(groups) != 1:
        raise ValueError(f"StagingPool: MoE layers with {sorted(groups)} NUMA groups; one "
                         "pool needs the same number in every layer")
    return [max(m.packed_groups()[g].expert_bytes for m in cpu) for g in range(groups.pop())]


def staging_bytes(cpu: Sequence[CpuMoE], slots: int) -> int:
    """GPU bytes of a pool of `slots` slots for `cpu`'s layers (0 slots: none), so a placement
    can leave it room before the pool is made."""
    return slots * sum(slot_widths(cpu)) if slots else 0


class StagingPool:
    """`slots` GPU slots of packed experts shared by every MoE layer of `cpu` (see the module
    docstring); `costs`: one expert's costs on this machine (`expert_split.costs_from_profile`)."""

    def __init__(self, cpu: Sequence[CpuMoE], slots: int, costs: SplitCosts,
                 device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"StagingPool: slots must be >= 1, got {slots}")
        widths = slot_widths(cpu)
        self.slots, self.costs, self.device = slots, costs, device
        self.least = least_tokens(costs)
        """Fewest tokens of a step for which a fetch may pay (fewer: no plan, no sync)."""
        with torch.inference_mode(False):
            self.packed = [torch.empty(slots * b, dtype=torch.uint8, device=device)
                           for b in widths]  # per NUMA group [slots * widest expert]
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None  # the last fetch's bytes are here
        self.freed = torch.cuda.Event() if cuda else None  # the last fetch's compute is queued
        self.steps = 0
        """Layer steps planned (with at least `least` tokens)."""
        self.fetched = 0
        """Experts fetched over those steps."""
        self._count = 0  # experts of the last `take`
        self._table = torch.empty(0, dtype=torch.int64)  # its table [E + 1]: expert -> slot
        log.info("fetch-or-compute: %d staging slots (%.1f MB), from %s tokens per expert",
                 slots, self.bytes / 1e6, self.least)

    @property
    def bytes(self) -> int:
        """GPU bytes of the pool."""
        return sum(p.numel() for p in self.packed)

    def take(self, layer: LayerSlots, cpu_ids: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """cpu_ids [T, K]: the layer's misses (-1 elsewhere) -> (the pool slot of each pair
        [T, K], -1 where not fetched, or None when nothing is; the CPU's ids with the fetched
        pairs -1, on the host once a plan read them there). Queues the chosen experts' copies;
        `compute` uses them."""
        if cpu_ids.shape[0] < self.least or capturing(cpu_ids.device):
            return None, cpu_ids
        host = cpu_ids.cpu()  # [T, K]: the step's one sync, these ids go on to the CPU link
        flat = host.reshape(-1)
        tokens = torch.bincount(flat[flat >= 0], minlength=layer.num_experts)  # [E]
        experts = plan_fetch(tokens, self.costs, self.slots)
        self.steps += 1
        self.fetched += len(experts)
        if not experts:
            return None, host
        table = slot_table(layer.num_experts, experts)  # [E + 1]
        self._copy(layer, experts)
        self._table = table.to(cpu_ids.device)
        # The pool's slots on the device for its compute; the CPU's ids from the host copy.
        return self._table[cpu_ids], torch.where(table[host] >= 0, -1, host)

    def _copy(self, layer: LayerSlots, experts: list[int]) -> None:
        """Copies `experts` into slots 0.. on the copy stream, after the last fetch's compute."""
        self._count = len(experts)
        with torch.inference_mode(False):
            if self.copy_stream is None:
                for slot, expert in enumerate(experts):
                    copy_expert(self.packed, slot, layer.host, expert, layer.parts)
                return
            assert self.freed is not None and self.copied is not None
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.freed)
                for slot, expert in enumerate(experts):
                    copy_expert(self.packed, slot, layer.host, expert, layer.parts)
                self.copied.record(self.copy_stream)

    def compute(self, layer: LayerSlots, x: torch.Tensor, ids: torch.Tensor,
                slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`LayerSlots.compute` over the experts of the last `take` (slot: its pool slots)."""
        n = self._count
        packed = [p[:n * part.expert_bytes] for p, part in zip(self.packed, layer.parts,
                                                               strict=True)]
        stream = torch.cuda.current_stream(self.device) if self.copied is not None else None
        if stream is not None:
            assert self.copied is not None and self.freed is not None
            stream.wait_event(self.copied)
        moe = layer.moe
        out = packed_slots(x, ids, slot, weights, packed, layer.parts, moe.weight_format,
                           moe.hidden, moe.group_size, self._table[:-1], layer.act_quant)
        if stream is not None:
            assert self.freed is not None
            self.freed.record(stream)
        return out
