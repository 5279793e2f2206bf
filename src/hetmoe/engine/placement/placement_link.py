"""`PlacementLink`: a MoE layer's `Link` when some of its experts are resident on the GPU.

It wraps the layer's CPU link (`HostLink` for GPU decode, `BackendLink` otherwise): `start`
reads the slot table on the device (`LayerSlots.split`), hands the CPU link the misses only
(resident ids set to -1) and computes the resident pairs on the GPU in the same stream while the
CPU works; `finish` adds both. A layer whose every expert is resident starts no CPU job at all.
With Expert Deferral the resident experts of the deferred slots are kept apart and join
`finish_late`, exactly as the CPU's deferred experts do. With a `StagingPool` (fetch-or-compute,
engine/placement/placement_fetch.py) a step outside CUDA graphs may also copy its heaviest misses to
the GPU and compute them there; the CPU gets the other misses. Implements `ops.moe_step.Link`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hetmoe.engine.placement.placement_fetch import StagingPool
from hetmoe.engine.placement.slots import LayerSlots
from hetmoe.ops.deferral import split_ids
from hetmoe.ops.fused import unpack_moe_inputs
from hetmoe.ops.moe_step import Link


class PlacementLink:
    """Resident experts on the GPU, the misses through `cpu` (see the module docstring)."""

    def __init__(self, cpu: Link, slots: LayerSlots, hidden: int, top_k: int,
                 pool: StagingPool | None = None) -> None:
        self.cpu, self.slots, self.pool = cpu, slots, pool
        self.hidden, self.top_k = hidden, top_k
        self._dtype = torch.float32
        self._cpu_started = False
        self._out: torch.Tensor | None = None  # the GPU's immediate pairs [T, H] fp32
        self._late: torch.Tensor | None = None  # the GPU's deferred pairs [T, H] fp32

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        slot, cpu_ids, fetched = self._split(ids)
        if cpu_ids is not None:
            self.cpu.start(x, cpu_ids, weights, deferred)
        self._gpu(x, ids, slot, fetched, weights, deferred)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        x, ids, weights = unpack_moe_inputs(stage, rows, self.hidden, self.top_k)
        slot, cpu_ids, fetched = self._split(ids)
        if cpu_ids is not None:
            misses = stage.clone()  # the same vector with the GPU's ids set to -1
            unpack_moe_inputs(misses, rows, self.hidden, self.top_k)[1].copy_(cpu_ids)
            self.cpu.start_packed(misses, rows, deferred)
        self._gpu(x, ids, slot, fetched, weights, deferred)

    def _split(self, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """ids [T, K] -> (resident slots, the CPU's ids or None, the pool's slots or None):
        the misses the pool fetches (`StagingPool.take`) leave the CPU's share (on the host
        when the pool read them there: the CPU link then copies nothing back)."""
        slot, cpu_ids = self.slots.split(ids)
        fetched = None
        if cpu_ids is not None and self.pool is not None:
            fetched, cpu_ids = self.pool.take(self.slots, cpu_ids)
        self._cpu_started = cpu_ids is not None
        return slot, cpu_ids, fetched

    def _gpu(self, x: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor,
             fetched: torch.Tensor | None, weights: torch.Tensor, deferred: int) -> None:
        """Queues the resident pairs' compute, then the fetched ones' (immediate and deferred
        apart)."""
        self._dtype = x.dtype
        t = x.shape[0]
        parts: list[tuple[Callable[..., torch.Tensor], torch.Tensor]] = []
        if self.slots.slots:
            parts.append((self.slots.compute, slot))
        if fetched is not None:
            assert self.pool is not None
            parts.append((functools.partial(self.pool.compute, self.slots), fetched))
        outs: list[torch.Tensor] = []  # [T, H] fp32 each
        lates: list[torch.Tensor] = []
        for compute, where in parts:
            if not deferred:
                outs.append(compute(x, ids, where, weights))
                continue
            # One call over the rows twice (immediate slots, then deferred): each expert is
            # read once, as a token's experts are distinct.
            now, later = split_ids(where, deferred)
            both = compute(torch.cat((x, x)), torch.cat((ids, ids)), torch.cat((now, later)),
                           torch.cat((weights, weights)))
            outs.append(both[:t])
            lates.append(both[t:])
        if not outs:  # no resident slot and nothing fetched this step
            outs = lates = [x.new_zeros(t, x.shape[1], dtype=torch.float32)]
        self._out = functools.reduce(torch.add, outs)
        self._late = functools.reduce(torch.add, lates) if deferred else None

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
