"""The static KV cache: per-layer buffers owned by the attention ops, slots and lengths here.

Every attention op that `allocate_kv(max_batch, max_len, dtype)` gets one row (slot) per
sequence; this object allocates them once, hands out free slots and tracks each slot's length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StaticKVCache:
    """Slots of a multi-sequence static KV cache over the model's attention ops."""

    def __init__(self, model: nn.Module, max_batch: int, max_len: int, dtype: torch.dtype) -> None:
        self.layers: list[Any] = [
            m for m in model.modules() if callable(getattr(m, "allocate_kv", None))
        ]
        if not self.layers:
            raise ValueError(
                "no attention layer uses the static KV cache: the rules must replace every "
                "attention module with static_kv_attention or mla_attention"
            )
        self.max_batch = max_batch
        self.max_len = max_len
        self.bytes = sum(layer.allocate_kv(max_batch, max_len, dtype) for layer in self.layers)
        self.lengths = [0] * max_batch
        """Tokens cached per slot."""
        self._free = list(range(max_batch - 1, -1, -1))
        self.allocations = [0] * max_batch
        """Times each slot was allocated: a prefix cache entry is valid while it is unchanged."""

    @property
    def free_slots(self) -> list[int]:
        """Slots not in use (their cache still holds what their last user left)."""
        return list(self._free)

    def allocate(self, slot: int | None = None, keep: int = 0) -> int:
        """A free slot (`slot` if given) holding its first `keep` cached tokens (0: empty);
        RuntimeError when all are in use, ValueError when `slot` is not free."""
        if not self._free:
            raise RuntimeError(f"all {self.max_batch} KV-cache slots are in use (max_batch)")
        if slot is None:
            slot = self._free[-1]
        if slot not in self._free:
            raise ValueError(f"KV-cache slot {slot} is not free")
        if not 0 <= keep <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} tokens, cannot keep {keep}")
        self._free.remove(slot)
        self.allocations[slot] += 1
        self.lengths[slot] = keep
        return slot

    def free(self, slot: int) -> None:
        """Returns a slot to the pool."""
        self.check_slot(slot)
        if slot in self._free:
            raise RuntimeError(f"KV-cache slot {slot} is freed twice")
        self._free.append(slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copies the first `length` cached tokens of slot `src` into slot `dst` (every layer);
        `dst` then holds `length` tokens."""
        self.check_slot(src)
        self.check_slot(dst)
        if not 0 <= length <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} tokens, cannot copy {length}")
        for layer in self.layers:
            for cache in layer.kv_tensors():  # [slots, len, ...]
                cache[dst, :length] = cache[src, :length]
        self.lengths[dst] = length

    def check_slot(self, slot: int) -> None:
        """ValueError unless 0 <= slot < max_batch."""
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"KV-cache slot {slot} out of range [0, {self.max_batch})")
