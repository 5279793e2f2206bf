"""The runner's one contract: a typed step in (`StepPlan`: prefill chunks of any number of
requests + decode rows), a typed output out (`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens `token_ids` written into `slot` from position `start`."""

    slot: int
    """KV-cache slot of the sequence."""
    token_ids: tuple[int, ...]
    """The chunk's tokens (at least one)."""
    start: int = 0
    """Position of the first token: the slot keeps its first `start` cached tokens."""
    every_position: bool = False
    """Return the logits of every position (prompt logprobs), not only the last one's."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("prefill needs at least one token")


@dataclass(frozen=True)
class StepPlan:
    """One runner step: the `prefills` chunks (ONE forward pass for all of them), then one
    batched decode step where slot `slots[b]` takes `token_ids[b]` at its own next position."""

    slots: tuple[int, ...] = ()
    """Decode rows' KV-cache slots (distinct)."""
    token_ids: tuple[int, ...] = ()
    """Each decode row's last sampled token, not yet in the cache."""
    greedy: bool = False
    """Every decode row takes the argmax: the runner returns tokens instead of logits, and with
    CUDA graphs may launch the next step before this one's tokens are read."""
    ahead: bool = False
    """With `greedy`: every row wants at least one more token after this step, so the runner
    launches the next step of the same slots early (it is discarded if the next plan differs)."""
    prefills: tuple[PrefillChunk, ...] = ()
    """Prompt chunks of other slots, prefilled before the decode rows."""

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.token_ids):
            raise ValueError(f"a decode step needs one token per slot, got {len(self.slots)} "
                             f"slots and {len(self.token_ids)} tokens")
        if not self.slots and not self.prefills:
            raise ValueError("a step needs a prefill chunk or a decode row, got neither")
        every = [*self.slots, *(c.slot for c in self.prefills)]
        if len(set(every)) != len(every):
            raise ValueError(f"a step got a slot twice: {every}")

    @property
    def decodes(self) -> bool:
        """Whether the plan has decode rows."""
        return bool(self.slots)


@dataclass(frozen=True)
class StepOutput:
    """What a step produced: per prefill chunk its logits; per decode row its logits (sampled
    plans) or argmax token (greedy plans)."""

    logits: torch.Tensor | None = None
    """[B, V] float32 of the decode rows, for plans that sample on the host."""
    tokens: tuple[int, ...] | None = None
    """Each decode row's argmax, for greedy plans."""
    prefill_logits: tuple[torch.Tensor, ...] = ()
    """Per chunk, in plan order: [T, V] float32 with `every_position`, else [1, V] (its last)."""
