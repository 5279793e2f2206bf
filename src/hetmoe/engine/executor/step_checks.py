"""Checks of a step's input before any work: slots, positions against the window, token ids.

Each raises a ValueError naming what is wrong (the slot, the start, the window, the ids)."""

from __future__ import annotations

from collections.abc import Sequence

from hetmoe.engine.executor.kv_cache import StaticKVCache
from hetmoe.engine.step import PrefillChunk, StepPlan


def check_decode_rows(plan: StepPlan, cache: StaticKVCache, max_seq_len: int,
                      vocab_size: int) -> None:
    """Every decode row's slot holds 1 to max_seq_len - 1 tokens; its token is in the
    vocabulary."""
    for slot in plan.slots:
        cache.check_slot(slot)
        if not 0 < cache.lengths[slot] < max_seq_len:
            raise ValueError(f"slot {slot} holds {cache.lengths[slot]} tokens; decode needs 1 "
                             f"to {max_seq_len - 1} (prefill first; the context window "
                             f"is full at {max_seq_len})")
    check_ids(plan.token_ids, vocab_size)


def check_chunk(chunk: PrefillChunk, cache: StaticKVCache, max_seq_len: int,
                vocab_size: int) -> None:
    """A prefill chunk starts within its slot's cached tokens and ends within the window."""
    cache.check_slot(chunk.slot)
    start, n = chunk.start, len(chunk.token_ids)
    if not 0 <= start <= cache.lengths[chunk.slot]:
        raise ValueError(f"prefill start {start} is beyond slot {chunk.slot}'s "
                         f"{cache.lengths[chunk.slot]} cached tokens")
    if start + n > max_seq_len:
        raise ValueError(f"{start + n} tokens do not fit the context window of "
                         f"{max_seq_len} (max_seq_len)")
    check_ids(chunk.token_ids, vocab_size)


def check_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id lies in [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} out of the vocabulary [0, {vocab_size})")
