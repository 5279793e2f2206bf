"""A step's prompt chunks and decode rows as ONE forward pass (`StepLayout`).

Ragged prefill chunks are grouped into padded passes: rows of one pass share a length S.

A step's prompt chunks (any number of requests, each at its own start) run as [B, S] rows: each
row's tokens at its own positions, then pad tokens at the following positions. Pads write keys
beyond their row's length, which no query attends (the mask is causal per row) and the next write
at those positions replaces, so every chunk's logits are those of prefilling it alone; their
hidden states are dropped. The MoE layers see all rows as one call: each expert is read once
for every prompt of the pass.

Padding costs compute, so chunks are grouped longest first and a pass takes the next chunk only
while its padded tokens stay within `MAX_PADDING` times its real ones; a row must also fit the
window with its pads (start + S <= max_len).

A step of several such passes, or of passes and decode rows [Bd, 1], runs as one row of tokens
[1, T] under a `RaggedKV` (ops/kv_batch.py): attention runs each pass and the decode rows apart,
every other op (the MoE layers above all) sees all T tokens at once, so each expert is read once
per step, not once per pass. A step of one pass and no decode rows runs as that pass [B, S].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetmoe.engine.step import PrefillChunk, StepOutput, StepPlan
from hetmoe.ops.kv_batch import KVBatch, RaggedKV

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


def step_layouts(plan: StepPlan, lengths: Sequence[int], max_len: int,
                 apart: bool = False) -> list[StepLayout]:
    """`plan`'s chunks and decode rows (at their slots' `lengths`) as one `StepLayout`; with
    `apart`, one per padded pass and no decode rows (the caller runs those)."""
    passes = prefill_passes(plan.prefills, max_len)
    if apart:
        return [StepLayout(plan.prefills, (p,)) for p in passes]
    starts = tuple(lengths[s] for s in plan.slots)
    return [StepLayout(plan.prefills, tuple(passes), plan.slots, plan.token_ids, starts)]


def chunk_rows(hidden: torch.Tensor, chunks: Sequence[PrefillChunk],
               step: PrefillPass) -> list[torch.Tensor]:
    """Per row of the pass, the hidden states [T, H] whose logits its chunk wants (every
    position, or the last), from the pass's final hidden [B, S, H]."""
    out = []
    for b, i in enumerate(step.rows):
        n = len(chunks[i].token_ids)
        out.append(hidden[b, :n] if chunks[i].every_position else hidden[b, n - 1:n])
    return out


@dataclass(frozen=True)
class StepLayout:
    """A step's prompt chunks in `passes` and its decode rows (`slots[b]` takes `token_ids[b]`
    at position `starts[b]`) as one forward pass (see the module docstring)."""

    chunks: tuple[PrefillChunk, ...]
    """The step's prompt chunks; `passes` index them."""
    passes: tuple[PrefillPass, ...]
    """The padded passes of the chunks this layout runs (all of them, or a subset)."""
    slots: tuple[int, ...] = ()
    """Decode rows' KV-cache slots."""
    token_ids: tuple[int, ...] = ()
    """Decode rows' tokens (not yet in the cache)."""
    starts: tuple[int, ...] = ()
    """Decode rows' positions (their slots' lengths)."""

    @property
    def rows(self) -> tuple[int, ...]:
        """The chunks this layout runs (indices into `chunks`), in pass order."""
        return tuple(i for p in self.passes for i in p.rows)

    @property
    def row_slots(self) -> list[int]:
        """Each batch row's slot: the passes' rows, then the decode rows."""
        return [*(self.chunks[i].slot for i in self.rows), *self.slots]

    @property
    def ragged(self) -> bool:
        """Whether the step mixes shapes (several passes, or passes and decode rows)."""
        return len(self.passes) + bool(self.slots) > 1

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, KVBatch | RaggedKV]:
        """ids [B, S] and a `KVBatch` for a step of one pass; else ids [1, T] and a `RaggedKV`
        whose parts are the passes, then the decode rows."""
        ids: list[int] = []
        positions: list[int] = []
        shapes: list[tuple[int, int, int]] = []  # per part: B, S, kv_len
        for p in self.passes:
            for i in p.rows:
                chunk = self.chunks[i]
                ids += [*chunk.token_ids, *[PAD_TOKEN] * (p.width - len(chunk.token_ids))]
                positions += range(chunk.start, chunk.start + p.width)
            shapes.append((len(p.rows), p.width, max(self.chunks[i].start for i in p.rows)
                           + p.width))
        if self.slots:
            ids += self.token_ids
            positions += self.starts
            shapes.append((len(self.slots), 1, max(self.starts) + 1))
        t = len(ids)
        index = torch.tensor([*ids, *positions, *self.row_slots]).to(device)  # one copy
        parts, offset, row = [], t, 2 * t
        for b, s, kv_len in shapes:
            parts.append(KVBatch(index[row:row + b], index[offset:offset + b * s].view(b, s),
                                 kv_len))
            offset, row = offset + b * s, row + b
        if not self.ragged:
            return index[:t].view(parts[0].positions.shape), parts[0]
        return index[None, :t], RaggedKV(tuple(parts), index[None, t:2 * t])

    def advance(self, lengths: list[int]) -> None:
        """Each slot's length after the pass: its chunk's end, or one more for a decode row."""
        for i in self.rows:
            chunk = self.chunks[i]
            lengths[chunk.slot] = chunk.start + len(chunk.token_ids)
        for slot in self.slots:
            lengths[slot] += 1

    def split(self, hidden: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """From the pass's final hidden ([B, S, H], or [1, T, H] when ragged): per chunk of
        `rows` the states [T_i, H] whose logits it wants (`chunk_rows`), and the decode rows'
        [Bd, H]."""
        flat, out, offset = hidden.reshape(-1, hidden.shape[-1]), [], 0  # [T, H]
        for p in self.passes:
            n = len(p.rows) * p.width
            out += chunk_rows(flat[offset:offset + n].view(len(p.rows), p.width, -1),
                              self.chunks, p)
            offset += n
        return out, flat[offset:]

    def output(self, out: torch.Tensor, logits: list[torch.Tensor],
               greedy: bool) -> StepOutput:
        """The step's output from the logits `out` [N, V] of `split`'s rows (each chunk's, then
        the decode rows'): each chunk's into `logits` (by chunk index), the decode rows' as
        logits, or argmax tokens when `greedy`."""
        sizes = [len(self.chunks[i].token_ids) if self.chunks[i].every_position else 1
                 for i in self.rows]
        parts = out.split([*sizes, len(self.slots)])
        for i, part in zip(self.rows, parts, strict=False):
            logits[i] = part
        if not self.slots:
            return StepOutput(prefill_logits=tuple(logits))
        if greedy:
            return StepOutput(tokens=tuple(parts[-1].argmax(-1).tolist()),
                              prefill_logits=tuple(logits))
        return StepOutput(logits=parts[-1], prefill_logits=tuple(logits))
