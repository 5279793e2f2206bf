"""Prefix cache over the static KV slots: a new prompt reuses the KV of the slot whose tokens
share its longest prefix.

A slot keeps what its cache holds when its request ends (a free slot is not wiped). Admission
finds the slot with the longest match: a free one is taken with its KV in place when the match
is all it holds (or it is the least recently used anyway); otherwise the matched tokens are
copied (a running request's shared system prompt, or a free slot's head whose tail stays
cached) into the least recently used free slot. Only the rest of the prompt is prefilled.
Exact: the kept KV is what a prefill of the same tokens at the same positions writes. An entry
is tied to its slot's allocation count, so a slot used outside the scheduler (`LLM.logits`)
is never taken for cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetmoe.engine.executor.kv_cache import StaticKVCache


@dataclass(frozen=True)
class Placement:
    """Where a prompt goes: `slot` to allocate, keeping its first `kept` tokens, after copying
    `copied` tokens from slot `source` into it (0: nothing to copy)."""

    slot: int
    kept: int = 0
    source: int = -1
    copied: int = 0

    @property
    def cached(self) -> int:
        """Prompt tokens not prefilled again."""
        return max(self.kept, self.copied)


class PrefixCache:
    """Which tokens each slot's KV holds, and where a new prompt is best placed."""

    def __init__(self, cache: StaticKVCache, enabled: bool = True) -> None:
        self.cache = cache
        self.enabled = enabled
        self._held: dict[int, tuple[int, list[int]]] = {}  # slot -> (allocation, tokens)
        self._last_use = [0] * cache.max_batch  # release tick per slot (LRU eviction)
        self._tick = 0

    def hold(self, slot: int, tokens: Sequence[int]) -> None:
        """Records that `slot`'s KV holds `tokens` (from position 0)."""
        if self.enabled:
            self._held[slot] = (self.cache.allocations[slot], list(tokens))

    def release(self, slot: int, tokens: Sequence[int] | None) -> None:
        """A freed slot holds `tokens` (None: nothing reusable, e.g. after a failure)."""
        self._tick += 1
        self._last_use[slot] = self._tick
        if tokens is None:
            self._held.pop(slot, None)
        else:
            self.hold(slot, tokens[: self.cache.lengths[slot]])

    def place(self, prompt: Sequence[int], reuse: bool = True) -> Placement:
        """Where `prompt` goes (one free slot must exist): the best match, at most all of the
        prompt but its last token (whose logits the prefill must give)."""
        free = self.cache.free_slots
        if not free:
            raise RuntimeError(f"all {self.cache.max_batch} KV-cache slots are in use")
        best, source = 0, -1
        if self.enabled and reuse:
            for slot, (allocation, tokens) in self._held.items():
                if allocation != self.cache.allocations[slot]:
                    continue
                limit = min(len(tokens), len(prompt) - 1, self.cache.lengths[slot])
                match = _common_prefix(tokens, prompt, limit)
                if match > best or (match == best and match and slot in free):
                    best, source = match, slot
        # The victim: least recently used; ties go to the slot `allocate()` would give.
        victim = min(reversed(free), key=lambda s: self._last_use[s])
        if best and source in free:
            # In place when the match is all the slot holds or the slot is the victim anyway;
            # else copy, so the rest of what it holds stays cached.
            if victim == source or len(self._held[source][1]) <= best:
                return Placement(source, kept=best)
        return Placement(victim, source=source, copied=best) if best else Placement(victim)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
