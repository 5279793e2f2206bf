"""`KVBatch`: what attention ops receive each step to use the engine's static KV cache.

The cache of each attention layer is `[max_batch, max_len, ...]`: one row (slot) per sequence.
A call carries B sequences of S new tokens each (prefill: B=1, S=prompt; decode: B slots, S=1),
every sequence at its own position. Ops write the new keys at `positions` of their `slots` rows and
attend over the first `kv_len` entries, masked causally per row.

Decode steps under CUDA graphs need a static window, yet attention should cost what the cache
holds, not what it could hold: `window_bucket` rounds the batch's longest length up to one of a
few widths (powers of two from a smallest one, then the cache length), one graph per width.

A step that mixes shapes (prompt chunks [B1, S1], [B2, S2], ... and decode rows [Bd, 1]) runs as
ONE row of tokens [1, T] under a `RaggedKV`: every op but attention works token by token, so the
MoE layers see all of the step's tokens in one expert call; attention ops run each part apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetmoe.ops.rope import RotaryEmbedding


@dataclass(frozen=True)
class KVBatch:
    """Per-call view of the static KV cache (built by the model runner)."""

    slots: torch.Tensor
    """[B] int64: cache row of each sequence."""
    positions: torch.Tensor
    """[B, S] int64: absolute position of each new token."""
    kv_len: int
    """Cache entries to attend over: max position + 1 (host int, so slicing needs no sync)."""

    def write(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Stores new [B, S, ...] entries and returns the rows' first kv_len entries [B, L, ...]."""
        cache[self.slots[:, None], self.positions] = new.to(cache.dtype)
        return cache[:, : self.kv_len].index_select(0, self.slots)

    def mask_or_causal(self, window: int | None = None) -> torch.Tensor | None:
        """`mask(window)`, or None when plain causal attention is the same: one sequence whose
        queries are all of its kv_len entries (a prefill from position 0) and no window shorter
        than it. None lets attention run a flash kernel, with no [S, S] mask in memory."""
        b, s = self.positions.shape
        if b == 1 and s == self.kv_len and (window is None or window >= s):
            return None
        return self.mask(window)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """[B, 1, S, L] bool, True where a query may attend: causal, optionally sliding-window."""
        keys = torch.arange(self.kv_len, device=self.positions.device)  # [L]
        queries = self.positions[:, :, None]  # [B, S, 1]
        allowed = keys <= queries
        if window is not None:
            allowed &= queries - keys < window
        return allowed[:, None]


@dataclass(frozen=True)
class RaggedKV:
    """Several `KVBatch` parts laid end to end as one row of tokens: part i's [B_i, S_i] tokens
    (row-major) follow part i-1's. Built by the model runner (engine/executor/prefill_batch.py)."""

    parts: tuple[KVBatch, ...]
    """Each part's slots [B_i] and positions [B_i, S_i]."""
    positions: torch.Tensor
    """[1, T] int64: every part's positions, flattened in order (T = sum of B_i * S_i)."""

    def __post_init__(self) -> None:
        total = sum(p.positions.numel() for p in self.parts)
        if self.positions.shape != (1, total):
            raise ValueError(f"RaggedKV: positions {tuple(self.positions.shape)} do not lay its "
                             f"parts' {total} tokens in one row (1, {total})")

    def split_call(self, attention: Callable[[torch.Tensor, RotaryEmbedding, KVBatch],
                                             torch.Tensor],
                   hidden: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """`attention(hidden_i [B_i, S_i, H], rotary_i, part_i) -> [B_i, S_i, H']` on each part
        of hidden [1, T, H] (rotary: HF's output for `positions`); the outputs as [1, T, H']."""
        outs, offset = [], 0
        for part in self.parts:
            b, s = part.positions.shape
            rows = slice(offset, offset + b * s)
            if isinstance(rotary, torch.Tensor):  # complex freqs_cis [1, T, D/2]
                part_rotary: RotaryEmbedding = rotary[:, rows].reshape(b, s, -1)
            else:
                cos, sin = rotary  # [1, T, D] each
                part_rotary = (cos[:, rows].reshape(b, s, -1), sin[:, rows].reshape(b, s, -1))
            out = attention(hidden[:, rows].reshape(b, s, -1), part_rotary, part)
            outs.append(out.reshape(1, b * s, -1))
            offset += b * s
        return torch.cat(outs, dim=1)


def window_bucket(length: int, smallest: int, limit: int) -> int:
    """The attention window of a decode step whose longest row holds `length` entries after the
    step: the smallest of smallest * 2**k and `limit` (the cache length) that is >= length."""
    if not 0 < length <= limit:
        raise ValueError(f"window_bucket: length {length} is outside 1..{limit} (the cache length)")
    width = smallest
    while width < length:
        width *= 2
    return min(width, limit)
