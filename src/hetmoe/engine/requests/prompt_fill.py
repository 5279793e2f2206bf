"""`PromptFill`: the requests whose prompt is being prefilled, and the chunks each step gives them.

A request's first choice is placed in a slot holding the longest cached prefix of its prompt
(engine/requests/prefix_cache.py); its prompt then runs in chunks under `EngineConfig.prefill_chunk`
tokens a step, beside the decode rows; once the whole prompt is in, its KV is copied into the
other choices' slots and each choice samples its first token. Part of the `Scheduler` (its
requests, failures and sampling), on the loop's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from hetmoe.engine.executor.adapters import assign_adapter
from hetmoe.engine.requests.logprobs import TokenLogprob, prompt_logprobs
from hetmoe.engine.requests.prefix_cache import PrefixCache
from hetmoe.engine.requests.request import Request
from hetmoe.engine.step import PrefillChunk

if TYPE_CHECKING:
    import torch

    from hetmoe.engine.executor.runner import ModelRunner


class FillOwner(Protocol):
    """What `PromptFill` uses of the `Scheduler` that owns it (engine/requests/scheduler.py):
    said here so this module does not import the scheduler, which imports it."""

    runner: ModelRunner
    prefix: PrefixCache
    _running: list[Request]

    def _fail(self, group: list[Request], exc: Exception) -> None: ...

    def _sample(self, batch: list[Request], logits: torch.Tensor | None,
                tokens: Sequence[int] | None,
                scored: tuple[TokenLogprob | None, ...] | None = None) -> None: ...


class PromptFill:
    """First choices being prefilled, in order of admission, for one `Scheduler`."""

    def __init__(self, scheduler: FillOwner) -> None:
        self.scheduler = scheduler
        self.requests: list[Request] = []

    def place(self, first: Request) -> None:
        """Gives a request's first choice a slot holding the longest cached prefix of its
        prompt (engine/requests/prefix_cache.py); its prefill starts after that prefix."""
        ids, cache = first.prompt_ids, self.scheduler.runner.cache
        try:
            echo = first.params.prompt_logprobs is not None  # scores every position
            place = self.scheduler.prefix.place(ids, reuse=not echo)
            first.slot = cache.allocate(place.slot, place.kept)
            assign_adapter(self.scheduler.runner, first.slot, first.params.adapter)
            if place.copied:
                self.scheduler.runner.settle()
                cache.copy(place.source, first.slot, place.copied)
        except Exception as exc:
            self.scheduler._fail(first.group, exc)
            return
        for request in first.group:
            request.cached_tokens = first.filled = place.cached
        self.requests.append(first)

    def chunks(self, decoding: bool) -> list[tuple[Request, PrefillChunk]]:
        """This step's prompt chunks: placed requests in order while `EngineConfig
        .prefill_chunk` tokens last (None: every prompt whole); with nothing `decoding` the
        first takes its whole prompt. A chunk the runner refuses fails its request alone."""
        limit = self.scheduler.runner.config.prefill_chunk
        budget = limit if limit is not None else -1  # -1: no limit
        fills: list[tuple[Request, PrefillChunk]] = []
        for first in list(self.requests):
            if budget == 0:
                break
            if first not in self.scheduler._running:  # cancelled or failed meanwhile
                self.requests.remove(first)
                continue
            ids, start = first.prompt_ids, first.filled
            echo = first.params.prompt_logprobs is not None  # scores every position: whole
            whole = echo or budget < 0 or (not fills and not decoding)
            end = len(ids) if whole else min(len(ids), start + budget)
            chunk = PrefillChunk(first.slot, tuple(ids[0 if echo else start:end]),
                                 0 if echo else start, every_position=echo)
            try:
                self.scheduler.runner.check_chunk(chunk)
            except Exception as exc:  # this prompt's failure is its own, not the batch's
                self.requests.remove(first)
                self.scheduler._fail([r for r in first.group if r in self.scheduler._running], exc)
                continue
            fills.append((first, chunk))
            if budget > 0:
                budget = max(0, budget - (end - start))
        return fills

    def prefilled(self, first: Request, chunk: PrefillChunk, logits: torch.Tensor) -> None:
        """After a request's chunk ran (`logits` [T, V]): once its whole prompt is in, copies
        the KV into the other choices' slots and samples each choice's first token."""
        group = [r for r in first.group if r in self.scheduler._running]
        ids, top = first.prompt_ids, first.params.prompt_logprobs
        if first not in group:  # failed meanwhile
            return
        first.filled = chunk.start + len(chunk.token_ids)
        if first.filled < len(ids):
            return
        scored: tuple[TokenLogprob | None, ...] | None = None
        if top is not None:
            scored = tuple(prompt_logprobs(logits, ids, top))
        try:
            self.requests.remove(first)
            self.scheduler.prefix.hold(first.slot, ids)
            cache = self.scheduler.runner.cache
            for request in group[1:]:
                request.slot = cache.allocate(self.scheduler.prefix.place(ids, reuse=False).slot)
                assign_adapter(self.scheduler.runner, request.slot, request.params.adapter)
                cache.copy(first.slot, request.slot, len(ids))
                request.filled = len(ids)
                self.scheduler.prefix.hold(request.slot, ids)
        except Exception as exc:  # this prompt's failure is its own, not the batch's
            self.scheduler._fail(group, exc)
            return
        rows = logits[-1][None].expand(len(group), -1)  # [n, V], a view
        self.scheduler._sample(group, rows, None, scored)
