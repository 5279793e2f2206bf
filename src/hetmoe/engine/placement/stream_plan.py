"""Which experts of one MoE layer a GPU prefill pass copies: the misses of the placement only.

Resident experts (engine/placement/slots.py) are already on the GPU, so a streamed pass copies only
a layer's misses, the experts without a slot. Of the misses (in expert order) it streams the first
k into the layer's staging buffer, side by side in that order; the CPU computes the other misses
(a split). k covering every miss streams them all and leaves the CPU nothing. Without a placement
the misses are every expert, so this is the first k experts, as before placements existed.
`LayerPass` is one layer's share for one pass; `LayerStreamer` (engine/placement/layer_stream.py)
copies and computes by it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from hetmoe.engine.placement.placement_plan import slot_table


@dataclass(frozen=True)
class LayerPass:
    """One MoE layer's experts in one streamed pass (see the module docstring)."""

    num_experts: int
    """Routed experts of the layer."""
    streamed: tuple[int, ...]
    """Experts copied into the staging buffer, in staging order (ascending ids)."""
    cpu: bool
    """Whether some misses are left to the CPU (the pass splits this layer)."""

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        """(first expert, count, first staging index) per run of consecutive streamed experts:
        one copy each per NUMA group."""
        runs: list[tuple[int, int, int]] = []
        for at, expert in enumerate(self.streamed):
            if runs and runs[-1][0] + runs[-1][1] == expert:
                first, count, start = runs[-1]
                runs[-1] = (first, count + 1, start)
            else:
                runs.append((expert, 1, at))
        return runs

    def local(self, device: torch.device) -> torch.Tensor:
        """[E + 1] int64: each expert's staging index, -1 for one not streamed (the last entry
        -1, as the slot table's, so an id of -1 reads -1)."""
        return slot_table(self.num_experts, self.streamed).to(device)


def layer_pass(num_experts: int, resident: Collection[int], k: int) -> LayerPass:
    """The share of a layer of `num_experts` experts whose `resident` experts have GPU slots,
    `k` >= 0 of its misses streamed (more than it has: all of them)."""
    if k < 0:
        raise ValueError(f"streamed experts per layer must be >= 0, got {k}")
    bad = [e for e in resident if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"resident expert ids {bad} outside [0, {num_experts})")
    misses = [e for e in range(num_experts) if e not in resident]
    return LayerPass(num_experts, tuple(misses[:k]), len(misses) > k)

