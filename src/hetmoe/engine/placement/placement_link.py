"""`PlacementLink`: a MoE layer's `Link` when some of its experts are resident on the GPU.

It wraps the layer's CPU link (`HostLink` for GPU decode, `BackendLink` otherwise): `start`
reads the slot table on the device (`LayerSlots.split`), hands the CPU link the misses only
(resident ids set to -1) and computes the resident pairs on the GPU in the same stream while the
CPU works; `finish` adds both. A layer whose every expert is resident starts no CPU job at all.
With Expert Deferral in the "score" order the resident experts of the deferred slots are kept
apart and join `finish_late`, exactly as the CPU's deferred experts do; in the "misses" order
(the default, ops/deferral.py) each token's slots are first reordered on the device, misses last
(`misses_last`), so the CPU's last d slots are its lowest-scored misses, and every resident slot
is computed at once (a layer with every expert resident then defers nothing: `finish_late` gives
None). With a `StagingPool` (fetch-or-compute,
engine/placement/placement_fetch.py) a step outside CUDA graphs may also copy its heaviest misses to
the GPU and compute them there; the CPU gets the other misses. Implements `ops.moe_step.Link`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hetmoe.config import DEFAULT_DEFER_ORDER
from hetmoe.engine.placement.placement_fetch import StagingPool
from hetmoe.engine.placement.slots import LayerSlots
from hetmoe.ops.deferral import check_defer_order, misses_last, split_ids
from hetmoe.ops.fused import unpack_moe_inputs
from hetmoe.ops.moe_step import Link


class PlacementLink:
    """Resident experts on the GPU, the misses through `cpu` (see the module docstring)."""

    def __init__(self, cpu: Link, slots: LayerSlots, hidden: int, top_k: int,
                 pool: StagingPool | None = None, defer_order: str = DEFAULT_DEFER_ORDER) -> None:
        check_defer_order(defer_order)
        self.cpu, self.slots, self.pool = cpu, slots, pool
        self.hidden, self.top_k = hidden, top_k
        self.defer_order = defer_order
        """Which experts a start with `deferred` defers (ops/deferral.py; graphs bake it in)."""
        self._dtype = torch.float32
        self._cpu_started = False
        self._out: torch.Tensor | None = None  # the GPU's immediate pairs [T, H] fp32
        self._late: torch.Tensor | None = None  # the GPU's deferred pairs [T, H] fp32 (or None)

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        ids, weights = self._ordered(ids, weights, deferred)
        slot, cpu_ids, fetched = self._split(ids)
        if cpu_ids is not None:
            self.cpu.start(x, cpu_ids, weights, deferred)
        self._gpu(x, ids, slot, fetched, weights, deferred)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        x, ids, weights = unpack_moe_inputs(stage, rows, self.hidden, self.top_k)
        ids, weights = self._ordered(ids, weights, deferred)
        slot, cpu_ids, fetched = self._split(ids)
        if cpu_ids is not None:
            misses = stage.clone()  # the same vector with the GPU's ids set to -1
            _, cpu_view, weight_view = unpack_moe_inputs(misses, rows, self.hidden, self.top_k)
            cpu_view.copy_(cpu_ids)
            if self._reorders(deferred):
                weight_view.copy_(weights)
            self.cpu.start_packed(misses, rows, deferred)
        self._gpu(x, ids, slot, fetched, weights, deferred)

    def _reorders(self, deferred: int) -> bool:
        """Whether this start reorders the slots ("misses" order, some deferred, some miss
        possible)."""
        return bool(deferred) and self.defer_order == "misses" and not self.slots.everything

    def _ordered(self, ids: torch.Tensor, weights: torch.Tensor, deferred: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, weights [T, K] with each token's misses last in the "misses" order (as given
        otherwise)."""
        if not self._reorders(deferred):
            return ids, weights
        return misses_last(ids, weights, self.slots.table[ids] < 0)

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
        apart; the resident ones all immediate in the "misses" order)."""
        self._dtype = x.dtype
        t = x.shape[0]
        # (compute, slots, whether its last `deferred` slots are late)
        parts: list[tuple[Callable[..., torch.Tensor], torch.Tensor, bool]] = []
        if self.slots.slots:
            parts.append((self.slots.compute, slot, self.defer_order == "score"))
        if fetched is not None:
            assert self.pool is not None
            parts.append((functools.partial(self.pool.compute, self.slots), fetched, True))
        outs: list[torch.Tensor] = []  # [T, H] fp32 each
        lates: list[torch.Tensor] = []
        for compute, where, splits in parts:
            if not (deferred and splits):
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
        self._late = functools.reduce(torch.add, lates) if deferred and lates else None

    def finish(self) -> torch.Tensor:
        assert self._out is not None, "PlacementLink.finish before start"
        out = self._join(self.cpu.finish() if self._cpu_started else None, self._out)
        assert out is not None
        return out

    def finish_late(self) -> torch.Tensor | None:
        """The deferred slots' output [T, H]; None when the last start deferred nothing (the
        "misses" order on a layer with every expert resident)."""
        return self._join(self.cpu.finish_late() if self._cpu_started else None, self._late)

    def _join(self, cpu: torch.Tensor | None, gpu: torch.Tensor | None) -> torch.Tensor | None:
        """The CPU's sum plus the GPU's, in the CPU link's dtype (x's without a CPU part)."""
        if cpu is None:
            return None if gpu is None else gpu.to(self._dtype)
        return cpu if gpu is None else (cpu.float() + gpu).to(cpu.dtype)
