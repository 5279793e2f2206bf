"""Typed decode steps: what the scheduler asks of the runner and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepPlan:
    """One batched decode step: slot `slots[b]` takes `token_ids[b]` at its own next position."""

    slots: tuple[int, ...]
    """KV-cache slots, one row each (distinct)."""
    token_ids: tuple[int, ...]
    """Each row's last sampled token, not yet in the cache."""
    greedy: bool = False
    """Every row takes the argmax: the runner returns tokens instead of logits, and with CUDA
    graphs may launch the next step before this one's tokens are read."""
    ahead: bool = False
    """With `greedy`: every row wants at least one more token after this step, so the runner
    launches the next step of the same slots early (it is discarded if the next plan differs)."""

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.token_ids) or not self.slots:
            raise ValueError(f"a decode step needs one token per slot, got {len(self.slots)} "
                             f"slots and {len(self.token_ids)} tokens")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"a decode step got a slot twice: {list(self.slots)}")


@dataclass(frozen=True)
class StepOutput:
    """What a decode step produced: logits (sampled plans) or argmax tokens (greedy plans)."""

    logits: torch.Tensor | None = None
    """[B, V] float32, for plans that sample on the host."""
    tokens: tuple[int, ...] | None = None
    """Each row's argmax, for greedy plans."""
