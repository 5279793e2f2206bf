"""`TrafficPolicy`: resident experts that follow the routing, moved between decode steps.

Each step counts every MoE layer's routing on the device (`LayerSlots.counting`). Every
`interval` steps the policy reads the counts (copied to pinned memory without waiting: the
copy queued at one update is read at the next) and, per layer, promotes the most routed
non-resident experts into the slots of the least routed resident ones while the hot one was
routed more than `MARGIN` times as often plus `MIN_EXCESS` (so uniform routing, whose counts
differ by noise only, seldom moves anything), at most `max_moves` per layer per update. A move
leaves the table at once, copies on a side stream and enters the table once its copy is done
(`LayerSlots.begin_move` / `end_moves`): queued steps keep reading what they were queued with,
and a captured graph stays valid (same tensors). Counts then halve, so old traffic fades.
"""

from __future__ import annotations

import torch

from hetmoe.engine.placement.slots import LayerSlots, Placement

MARGIN = 1.5
"""A hot expert replaces a cold one only when routed more than this many times as often..."""

MIN_EXCESS = 16
"""...plus this many routings (over the decayed counts)."""


class TrafficPolicy:
    """Moves a `Placement`'s experts toward the measured traffic (see the module docstring)."""

    def __init__(self, placement: Placement, interval: int, max_moves: int = 4,
                 margin: float = MARGIN, min_excess: int = MIN_EXCESS) -> None:
        if interval < 1 or max_moves < 1:
            raise ValueError(f"TrafficPolicy: interval and max_moves must be >= 1, got "
                             f"{interval}, {max_moves}")
        self.placement, self.interval, self.max_moves = placement, interval, max_moves
        self.margin, self.min_excess = margin, min_excess
        self.steps = 0
        self.moves = 0
        """Experts promoted so far."""
        layers = placement.layers
        for slots in layers:
            slots.counting = True
        cuda = placement.device.type == "cuda"
        self._host = torch.zeros(len(layers), layers[0].num_experts if layers else 0,
                                 dtype=torch.int64, pin_memory=cuda)
        self._copied: torch.cuda.Event | None = None
        self._stream = torch.cuda.Stream(placement.device) if cuda else None

    def after_step(self) -> None:
        """Called between decode steps (on the thread that launches them)."""
        for slots in self.placement.layers:
            slots.end_moves()
        self.steps += 1
        if self.steps % self.interval:
            return
        if self._copied is not None and not self._copied.query():
            return  # the last copy of the counts is not there yet: next time
        counts = self._host.clone()
        self._queue_counts()
        if self._copied is None and self.placement.device.type == "cuda":
            return
        for slots, layer in zip(self.placement.layers, counts, strict=True):
            self.moves += self._promote(slots, layer)
            slots.end_moves()  # the CPU device's copies are done already

    def _queue_counts(self) -> None:
        """Copies the counts to the host (pinned: no wait on CUDA) and halves them."""
        with torch.inference_mode(False):
            for i, slots in enumerate(self.placement.layers):
                self._host[i].copy_(slots.counts, non_blocking=True)
                slots.counts.div_(2, rounding_mode="floor")
        if self.placement.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _promote(self, slots: LayerSlots, counts: torch.Tensor) -> int:
        """Starts this layer's moves; how many."""
        resident = [(int(counts[e]), s, e) for s, e in enumerate(slots.resident) if e >= 0]
        taken = set(slots.resident) | slots.arriving()
        others = sorted(((int(c), e) for e, c in enumerate(counts.tolist()) if e not in taken),
                        reverse=True)
        resident.sort()
        moved = 0
        for (hot, expert), (cold, slot, _) in zip(others, resident, strict=False):
            if moved == self.max_moves or hot <= self.margin * cold + self.min_excess:
                break
            slots.begin_move(slot, expert, self._stream)
            moved += 1
        return moved
