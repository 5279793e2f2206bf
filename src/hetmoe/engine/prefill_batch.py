"""Ragged prefill chunks as padded forward passes: rows of one pass share a length S.

A step's prompt chunks (any number of requests, each at its own start) run as [B, S] rows: each
row's tokens at its own positions, then pad tokens at the following positions. Pads write keys
beyond their row's length, which no query attends (the mask is causal per row) and the next write
at those positions replaces, so every chunk's logits are those of prefilling it alone; their
hidden states are dropped. The MoE layers see all rows as one call: each expert is read once
for every prompt of the pass.

Padding costs compute, so chunks are grouped longest first and a pass takes the next chunk only
while its padded tokens stay within `MAX_PADDING` times its real ones; a row must also fit the
window with its pads (start + S <= max_len).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetmoe.engine.step import PrefillChunk
from hetmoe.ops.kv_batch import KVBatch

MAX_PADDING = 2.0
"""A pass's padded tokens (B * S) may be at most this many times its real tokens."""
PAD_TOKEN = 0
"""The id fed at pad positions (any id in the vocabulary; its outputs are dropped)."""


@dataclass(frozen=True)
class PrefillPass:
    """One padded forward pass: `rows[b]` indexes the step's chunks."""

    rows: tuple[int, ...]
    """Indices into the step's chunks, one per batch row."""
    width: int
    """S: the longest chunk of the pass; shorter rows are padded to it."""

    def tensors(self, chunks: Sequence[PrefillChunk],
                device: torch.device) -> tuple[torch.Tensor, KVBatch]:
        """ids [B, S] and the pass's `KVBatch` (positions [B, S], slots [B])."""
        ids, positions, slots = [], [], []
        for i in self.rows:
            chunk = chunks[i]
            pad = self.width - len(chunk.token_ids)
            ids.append([*chunk.token_ids, *[PAD_TOKEN] * pad])
            positions.append(list(range(chunk.start, chunk.start + self.width)))
            slots.append(chunk.slot)
        kv_len = max(chunks[i].start for i in self.rows) + self.width
        index = torch.tensor([*ids, *positions]).to(device)  # one copy: [2B, S]
        b = len(self.rows)
        return index[:b], KVBatch(torch.tensor(slots, device=device), index[b:], kv_len)


def prefill_passes(chunks: Sequence[PrefillChunk], max_len: int) -> list[PrefillPass]:
    """The chunks grouped into padded passes (see the module docstring), longest first."""
    order = sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids))
    groups: list[list[int]] = []
    real = 0
    for i in order:
        n = len(chunks[i].token_ids)
        if groups:
            group = groups[-1]
            width = len(chunks[group[0]].token_ids)  # the group's longest
            if (chunks[i].start + width <= max_len
                    and (len(group) + 1) * width <= MAX_PADDING * (real + n)):
                group.append(i)
                real += n
                continue
        groups.append([i])
        real = n
    return [PrefillPass(tuple(g), len(chunks[g[0]].token_ids)) for g in groups]


def chunk_rows(hidden: torch.Tensor, chunks: Sequence[PrefillChunk],
               step: PrefillPass) -> list[torch.Tensor]:
    """Per row of the pass, the hidden states [T, H] whose logits its chunk wants (every
    position, or the last), from the pass's final hidden [B, S, H]."""
    out = []
    for b, i in enumerate(step.rows):
        n = len(chunks[i].token_ids)
        out.append(hidden[b, :n] if chunks[i].every_position else hidden[b, n - 1:n])
    return out
