"""`ModelRunner`: tensors in, logits out, over the static KV cache. No sampling, no text.

The stable interface the engine and the server's scheduler drive (single-threaded):

- `prefill(slot, token_ids, start=0) -> [V]`: runs a sequence's tokens into `slot` from position
  `start` (0 = a new sequence; start = the slot's length extends it) and returns the last
  position's logits; `prefill_logits` returns all positions' [T, V].
- `decode(slots, token_ids) -> [B, V]`: one new token for each of B slots, each at its own
  position (the slot's length), in ONE forward pass: one MoE call per layer for the whole batch.
- `greedy(slot, token, limit=None) -> iterator of int`: greedy decode of one slot from its last
  token, one token per step until the caller stops (the hybrid runner launches each step before
  the previous one's token is read; `limit` keeps it from launching steps never read).
- `max_batch`, `max_seq_len`, `vocab_size`, `lengths[slot]`; `cache.allocate()` / `cache.free()`.

Logits are float32. The HF decoder layers run unchanged; the runner owns embedding, rotary
positions, the final norm and `lm_head`, and passes a `KVBatch` down to the attention ops.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from hetmoe.engine.kv_cache import StaticKVCache
from hetmoe.ops.kv_batch import KVBatch


class ModelRunner:
    """Prefill and batched decode of an injected model over a multi-slot static KV cache."""

    def __init__(
        self, model: Any, device: torch.device, dtype: torch.dtype, max_batch: int,
        max_seq_len: int,
    ) -> None:
        self.model = model  # the HF causal LM, injected
        self.base: Any = getattr(model, model.base_model_prefix)
        self.device = device
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.vocab_size = int(model.config.vocab_size)
        self.cache = StaticKVCache(model, max_batch, max_seq_len, dtype)
        self.lengths = self.cache.lengths

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Logits [V] after running `token_ids` into `slot` from position `start`."""
        return self._prefill(slot, token_ids, start)[-1]

    @torch.inference_mode()
    def prefill_logits(self, slot: int, token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Like `prefill`, but the logits of every position: [T, V]."""
        return self._prefill(slot, token_ids, start, every_position=True)

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [B, V] after appending token_ids[b] to slots[b] (each at its own position)."""
        if len(slots) != len(token_ids) or not slots:
            raise ValueError(f"decode needs one token per slot, got {len(slots)} slots and "
                             f"{len(token_ids)} tokens")
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode got a slot twice: {list(slots)}")
        for slot in slots:
            self.cache.check_slot(slot)
            if not 0 < self.lengths[slot] < self.max_seq_len:
                raise ValueError(
                    f"slot {slot} holds {self.lengths[slot]} tokens; decode needs 1 to "
                    f"{self.max_seq_len - 1} (prefill first; the context window is full at "
                    f"{self.max_seq_len})"
                )
        self._check_ids(token_ids)
        starts = [self.lengths[s] for s in slots]
        # One host-to-device copy for the step's three index vectors (each copy waits for it).
        index = torch.tensor([list(token_ids), starts, list(slots)]).to(self.device)  # [3, B]
        ids, positions = index[0, :, None], index[1, :, None]  # [B, 1] each
        kv = KVBatch(index[2], positions, max(starts) + 1)
        hidden = self._forward(ids, kv)[:, 0]  # [B, H]
        for slot in slots:
            self.lengths[slot] += 1
        return self.model.lm_head(hidden).float()

    def greedy(self, slot: int, token: int,
               limit: int | None = None) -> Generator[int, None, None]:
        """Greedy decode of `slot` after `token` (its last sampled token, not yet in the cache):
        yields the next token of each step until the caller stops, `limit` tokens were yielded
        or the window is full."""
        yielded = 0
        while self.lengths[slot] < self.max_seq_len and (limit is None or yielded < limit):
            token = int(self.decode([slot], [token])[0].argmax())
            yielded += 1
            yield token

    def _prefill(
        self, slot: int, token_ids: Sequence[int], start: int, every_position: bool = False
    ) -> torch.Tensor:
        self.cache.check_slot(slot)
        n = len(token_ids)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if not 0 <= start <= self.lengths[slot]:
            raise ValueError(f"prefill start {start} is beyond slot {slot}'s "
                             f"{self.lengths[slot]} cached tokens")
        if start + n > self.max_seq_len:
            raise ValueError(f"{start + n} tokens do not fit the context window of "
                             f"{self.max_seq_len} (max_seq_len)")
        self._check_ids(token_ids)
        ids = torch.tensor([list(token_ids)], device=self.device)  # [1, T]
        positions = torch.arange(start, start + n, device=self.device)[None]  # [1, T]
        kv = KVBatch(torch.tensor([slot], device=self.device), positions, start + n)
        hidden = self._forward(ids, kv)[0]  # [T, H]
        self.lengths[slot] = start + n
        return self.model.lm_head(hidden if every_position else hidden[-1:]).float()

    def _forward(self, ids: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        """ids [B, S] -> final hidden states [B, S, H] (after the last norm)."""
        hidden = self.base.embed_tokens(ids)
        rotary = self.base.rotary_emb(hidden, kv.positions)
        for layer in self.base.layers:
            hidden = layer(
                hidden, attention_mask=None, position_ids=kv.positions,
                position_embeddings=rotary, kv=kv,
            )
        return self.base.norm(hidden)

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of the vocabulary [0, {self.vocab_size})")
