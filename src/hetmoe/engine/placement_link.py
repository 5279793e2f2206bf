"""`PlacementLink`: a MoE layer's `Link` when some of its experts are resident on the GPU.

It wraps the layer's CPU link (`HostLink` for GPU decode, `BackendLink` otherwise): `start`
reads the slot table on the device (`LayerSlots.split`), hands the CPU link the misses only
(resident ids set to -1) and computes the resident pairs on the GPU in the same stream while the
CPU works; `finish` adds both. A layer whose every expert is resident starts no CPU job at all.
With Expert Deferral the resident experts of the deferred slots are kept apart and join
`finish_late`, exactly as the CPU's deferred experts do. Implements `ops.moe_step.Link`.
"""

from __future__ import annotations

import torch

from hetmoe.engine.placement import LayerSlots
from hetmoe.ops.deferral import split_ids
from hetmoe.ops.fused import unpack_moe_inputs
from hetmoe.ops.moe_step import Link


class PlacementLink:
    """Resident experts on the GPU, the misses through `cpu` (see the module docstring)."""

    def __init__(self, cpu: Link, slots: LayerSlots, hidden: int, top_k: int) -> None:
        self.cpu, self.slots = cpu, slots
        self.hidden, self.top_k = hidden, top_k
        self._dtype = torch.float32
        self._cpu_started = False
        self._out: torch.Tensor | None = None  # the GPU's immediate pairs [T, H] fp32
        self._late: torch.Tensor | None = None  # the GPU's deferred pairs [T, H] fp32

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        slot, cpu_ids = self.slots.split(ids)
        self._cpu_started = cpu_ids is not None
        if cpu_ids is not None:
            self.cpu.start(x, cpu_ids, weights, deferred)
        self._gpu(x, ids, slot, weights, deferred)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        x, ids, weights = unpack_moe_inputs(stage, rows, self.hidden, self.top_k)
        slot, cpu_ids = self.slots.split(ids)
        self._cpu_started = cpu_ids is not None
        if cpu_ids is not None:
            misses = stage.clone()  # the same vector with the resident ids set to -1
            unpack_moe_inputs(misses, rows, self.hidden, self.top_k)[1].copy_(cpu_ids)
            self.cpu.start_packed(misses, rows, deferred)
        self._gpu(x, ids, slot, weights, deferred)

    def _gpu(self, x: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor,
             weights: torch.Tensor, deferred: int) -> None:
        """Queues the resident pairs' compute (immediate and deferred apart)."""
        self._dtype = x.dtype
        if not deferred:
            self._out, self._late = self.slots.compute(x, ids, slot, weights), None
            return
        # One call over the rows twice (immediate slots, then deferred): each expert is read
        # once, as a token's experts are distinct.
        now, late = split_ids(slot, deferred)
        t = x.shape[0]
        both = self.slots.compute(torch.cat((x, x)), torch.cat((ids, ids)),
                                  torch.cat((now, late)), torch.cat((weights, weights)))
        self._out, self._late = both[:t], both[t:]

    def finish(self) -> torch.Tensor:
        assert self._out is not None, "PlacementLink.finish before start"
        return self._join(self.cpu.finish() if self._cpu_started else None, self._out)

    def finish_late(self) -> torch.Tensor:
        assert self._late is not None, "PlacementLink.finish_late without deferred slots"
        return self._join(self.cpu.finish_late() if self._cpu_started else None, self._late)

    def _join(self, cpu: torch.Tensor | None, gpu: torch.Tensor) -> torch.Tensor:
        """The CPU's sum plus the GPU's, in the CPU link's dtype (x's without a CPU part)."""
        if cpu is None:
            return gpu.to(self._dtype)
        return (cpu.float() + gpu).to(cpu.dtype)
