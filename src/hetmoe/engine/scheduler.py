"""Continuous batching: concurrent requests share the runner's KV slots and decode steps.

One thread owns the runner. Each step it admits waiting requests into free slots (one prefill
each), then decodes every active sequence in ONE batched `decode` call, so each expert's weights
are read once per step for the whole batch. Outputs leave through each request's `sink` callback
(called on the scheduler thread); `cancel()` frees the slot at the next step.
"""

from __future__ import annotations

import collections
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class RequestParams:
    """Per-request generation settings (already validated by the caller)."""

    max_tokens: int
    """Tokens to generate at most (the context window may stop it sooner)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept; 1 keeps all."""
    top_k: int = 0
    """Most likely tokens kept; 0 or -1 keeps all."""
    seed: int | None = None
    """Seed of this request's own generator; None draws one."""
    stop: tuple[str, ...] = ()
    """Strings that end the answer (not included in it)."""


@dataclass(frozen=True)
class Event:
    """What a request produced in one step; the last one has `finish_reason` set."""

    text: str
    """New answer text since the previous event (may be empty)."""
    token_ids: tuple[int, ...]
    """Tokens sampled since the previous event."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens sampled so far, end-of-sequence included."""
    finish_reason: str | None = None
    """`stop`, `length`, `cancelled` or `error`; None while generating."""
    error: str | None = None
    """What went wrong when `finish_reason == "error"`."""


class Runner(Protocol):
    """What the scheduler needs from the model runner."""

    max_batch: int
    max_seq_len: int

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor: ...  # [V]

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor: ...  # [B, V]


class QueueFull(Exception):
    """Raised by `submit` when the waiting queue is at its limit."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: RequestParams
    sink: Callable[[Event], None]
    text: TextStream
    generator: torch.Generator
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    cancelled: bool = False


class RequestHandle:
    """The caller's side of a submitted request."""

    def __init__(self, request: _Request, scheduler: Scheduler) -> None:
        self._request = request
        self._scheduler = scheduler

    def cancel(self) -> None:
        """Stops generation; the slot and its KV cache are freed at the next step."""
        self._scheduler._cancel(self._request)


class Scheduler:
    """Admission, batched decode loop and per-request stopping over a multi-slot runner."""

    def __init__(
        self,
        runner: Runner,
        decode_text: Callable[[list[int]], str],
        eos_token_ids: Sequence[int],
        max_queue: int = 64,
    ) -> None:
        self.runner = runner
        self.max_queue = max_queue
        self._decode_text = decode_text
        self._eos = frozenset(eos_token_ids)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._free_slots = list(range(runner.max_batch - 1, -1, -1))
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="hetmoe-scheduler", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def submit(
        self, prompt_ids: Sequence[int], params: RequestParams, sink: Callable[[Event], None]
    ) -> RequestHandle:
        """Queues a request; raises QueueFull at the limit, ValueError beyond the context."""
        total = len(prompt_ids) + params.max_tokens
        if not prompt_ids or total > self.runner.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the context window of {self.runner.max_seq_len} tokens"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = _Request(
            prompt_ids=list(prompt_ids),
            params=params,
            sink=sink,
            text=TextStream(self._decode_text, params.stop),
            generator=torch.Generator().manual_seed(seed % (1 << 63)),
        )
        with self._wake:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(
                    f"{len(self._waiting)} requests wait already (max_queue={self.max_queue})"
                )
            self._waiting.append(request)
            self._wake.notify()
        return RequestHandle(request, self)

    def stop(self) -> None:
        """Ends the loop; waiting and running requests finish as `cancelled`."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _cancel(self, request: _Request) -> None:
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopped or self._waiting or self._running):
                    self._wake.wait()
                if self._stopped:
                    break
                self._drop_cancelled()
                admitted = []
                while self._waiting and self._free_slots:
                    request = self._waiting.popleft()
                    request.slot = self._free_slots.pop()
                    admitted.append(request)
            try:
                self._step(admitted)
            except Exception as exc:  # a failing step fails its requests, never the server
                self._fail_all(f"{type(exc).__name__}: {exc}")
        for request in [*self._running, *self._waiting]:
            self._finish(request, "cancelled")

    def _step(self, admitted: list[_Request]) -> None:
        for request in admitted:
            self._running.append(request)
            logits = self.runner.prefill(request.slot, request.prompt_ids)  # [V]
            self._advance(request, logits)
        batch = [r for r in self._running if r not in admitted]
        if not batch:
            return
        slots = [r.slot for r in batch]
        last = [r.output_ids[-1] for r in batch]
        logits = self.runner.decode(slots, last)  # [B, V]
        for row, request in enumerate(batch):
            self._advance(request, logits[row])

    def _advance(self, request: _Request, logits: torch.Tensor) -> None:
        """Samples one token for `request`, emits its text, finishes it when it stops."""
        token = sample_token(logits, request.params, request.generator)
        request.output_ids.append(token)
        params = request.params
        reason = None
        if token in self._eos:
            reason = "stop"
            delta = request.text.flush()
        else:
            delta, hit_stop = request.text.push(token)
            if hit_stop:
                reason = "stop"
            elif len(request.output_ids) >= params.max_tokens:
                reason = "length"
                delta += request.text.flush()
        if reason is None:
            request.sink(self._event(request, delta, token))
            return
        request.sink(self._event(request, delta, token, reason))
        self._release(request)

    def _event(
        self, request: _Request, text: str, token: int, reason: str | None = None
    ) -> Event:
        return Event(
            text=text,
            token_ids=(token,),
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(request.output_ids),
            finish_reason=reason,
        )

    def _release(self, request: _Request) -> None:
        if request in self._running:
            self._running.remove(request)
        with self._wake:
            self._free_slots.append(request.slot)

    def _drop_cancelled(self) -> None:
        """Called under the lock: cancelled requests leave the queue and give back their slot."""
        for request in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(request)
            self._finish(request, "cancelled")
        for request in [r for r in self._running if r.cancelled]:
            self._running.remove(request)
            self._free_slots.append(request.slot)
            self._finish(request, "cancelled")

    def _fail_all(self, message: str) -> None:
        for request in list(self._running):
            self._release(request)
            self._finish(request, "error", message)

    def _finish(self, request: _Request, reason: str, error: str | None = None) -> None:
        request.sink(
            Event(
                text="",
                token_ids=(),
                prompt_tokens=len(request.prompt_ids),
                completion_tokens=len(request.output_ids),
                finish_reason=reason,
                error=error,
            )
        )


def sample_token(logits: torch.Tensor, params: RequestParams, generator: torch.Generator) -> int:
    """One token from `logits` [V]: greedy at temperature 0, else top-k / top-p sampling."""
    logits = logits.float().cpu()  # [V]; the generator lives on the CPU for reproducibility
    if params.temperature == 0.0 or params.top_k == 1:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Incremental detokenization with stop strings.

    Text is released only when its UTF-8 bytes are complete and it cannot be the start of a stop
    string; a found stop string ends the text before it.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # tokens before this index are fully in `text`
        self._read = 0  # tokens before this index have been decoded
        self.text = ""
        self._sent = 0  # characters of `text` already returned

    def push(self, token: int) -> tuple[str, bool]:
        """Adds a token; returns (text now safe to send, whether a stop string was found)."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release()

    def flush(self) -> str:
        """The rest of the text at the end of generation (held-back characters included)."""
        tail = self._decode(self._ids[self._prefix :])
        self.text += tail[len(self._decode(self._ids[self._prefix : self._read])) :]
        self._prefix = self._read = len(self._ids)
        delta, _ = self._release(final=True)
        return delta

    def _release(self, final: bool = False) -> tuple[str, bool]:
        start = max(0, self._sent - self._longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            delta, self._sent = self.text[self._sent :], len(self.text)
            return delta, True
        safe = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self._sent : max(safe, self._sent)]
        self._sent = max(safe, self._sent)
        return delta, False

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that starts some stop string."""
        for size in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
