"""The generation loop: continuous batching over the runner's KV slots and decode steps.

The only loop of the engine: `LLM.generate / stream / chat` run it synchronously in the caller's
thread (`run_once` until their request ends), the server on a thread of its own. Each step it
admits waiting requests into free slots (one prefill each), then decodes every other active
sequence in ONE batched step (`runner.step(StepPlan)`), so each expert's weights are read once
per step for the whole batch; a batch of greedy requests gets tokens, with the next step launched
ahead by the runner. Each request keeps its own sampler (seed) and stop strings; EOS, stop
strings, `max_new_tokens` and a full context window end it here and nowhere else. Outputs leave
through each request's `sink` callback (on the loop's thread); `cancel()` frees the slot at the
next step.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetmoe.engine.sampler import Sampler, SamplingParams
from hetmoe.engine.step import StepPlan
from hetmoe.engine.text_stream import CONTEXT_TOKENS, TextStream

if TYPE_CHECKING:
    import torch

    from hetmoe.engine.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """What a request produced in one step; the last one has `finish_reason` set."""

    text: str
    """New answer text since the previous event (may be empty)."""
    token_ids: tuple[int, ...]
    """Tokens sampled since the previous event."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens sampled so far, end-of-sequence included."""
    finish_reason: str | None = None
    """`stop`, `length` (max_new_tokens or a full context window), `cancelled` or `error`;
    None while generating."""
    error: str | None = None
    """What went wrong when `finish_reason == "error"`."""


class QueueFull(Exception):
    """Raised by `submit` when the waiting queue is at its limit."""


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    sampler: Sampler
    text: TextStream
    ignore_eos: bool = False
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
    """Admission, the batched decode loop and per-request stopping over a `ModelRunner`.

    While a scheduler runs, it is the only user of the runner and its KV-cache slots.
    """

    def __init__(
        self,
        runner: ModelRunner,
        decode_text: Callable[[list[int]], str],
        eos_token_ids: Sequence[int] | frozenset[int],
        max_queue: int = 64,
        threaded: bool = True,
    ) -> None:
        """`threaded`: run the loop on a thread of its own (a server); else the caller drives it
        with `run_once`."""
        self.runner = runner
        self.max_queue = max_queue
        self._decode_text = decode_text
        self._eos = frozenset(eos_token_ids)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._wake = threading.Condition()
        self._stopped = False
        self.decode_steps = 0
        """Batched decode calls so far."""
        self.decode_rows = 0
        """Sequences decoded so far, summed over steps (rows / steps = mean batch size)."""
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="hetmoe-scheduler",
                                            daemon=True)
            self._thread.start()

    @property
    def threaded(self) -> bool:
        """Whether the loop runs on a thread of its own (else the caller runs `run_once`)."""
        return self._thread is not None

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet admitted to a slot."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """True while the loop accepts and serves requests."""
        running = self._thread is None or self._thread.is_alive()
        return running and not self._stopped

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        ignore_eos: bool = False,
        fit_window: bool = True,
    ) -> RequestHandle:
        """Queues a request; QueueFull at the queue limit, ValueError for an empty prompt or one
        beyond the context window.

        `fit_window`: refuse a request whose prompt + max_new_tokens exceed the window (the
        API's contract); False lets it end with `length` when the window is full (`LLM`).
        `ignore_eos` generates exactly `max_new_tokens` (benchmarks of random-weight models).
        """
        window = self.runner.max_seq_len
        total = len(prompt_ids) + params.max_new_tokens
        if not prompt_ids or len(prompt_ids) > window or (fit_window and total > window):
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{total} exceeds the context window of {window} tokens"
            )
        text = TextStream(self._decode_text, params.stop, list(prompt_ids)[-CONTEXT_TOKENS:])
        request = _Request(list(prompt_ids), params, sink, Sampler(params), text, ignore_eos)
        with self._wake:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            # Requests that will have to wait for a slot: the queue proper.
            queued = len(self._waiting) + len(self._running) - self.runner.max_batch
            if queued >= self.max_queue:
                raise QueueFull(
                    f"all {self.runner.max_batch} slots are busy and {queued} requests wait "
                    f"already (max_queue={self.max_queue})"
                )
            self._waiting.append(request)
            self._wake.notify()
        return RequestHandle(request, self)

    def stop(self) -> None:
        """Ends the loop; waiting and running requests finish as `cancelled`."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._drain()

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
            self.run_once()
        self._drain()

    def run_once(self) -> None:
        """One step of the loop: admissions (one prefill each), then one batched decode step."""
        with self._wake:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._finish(request, "cancelled")
            admitted: list[_Request] = []
            while self._waiting and len(self._running) < self.runner.max_batch:
                admitted.append(self._waiting.popleft())
                self._running.append(admitted[-1])
        try:
            self._step(admitted)
        except Exception as exc:  # a failed batched decode fails its rows, never the loop
            log.exception("a decode step failed")
            for request in list(self._running):
                self._release(request)
                self._finish(request, "error", f"{type(exc).__name__}: {exc}")

    def _drain(self) -> None:
        for request in list(self._running):
            self._release(request)
            self._finish(request, "cancelled")
        for request in self._waiting:
            self._finish(request, "cancelled")
        self._waiting.clear()

    def _step(self, admitted: list[_Request]) -> None:
        for request in [r for r in self._running if r.cancelled]:
            self._release(request)
            self._finish(request, "cancelled")
        batch = [r for r in self._running if r.output_ids]  # sequences past their prefill
        for request in admitted:
            if request in self._running:  # not cancelled meanwhile
                try:
                    request.slot = self.runner.cache.allocate()
                    logits = self.runner.prefill(request.slot, request.prompt_ids)  # [V]
                except Exception as exc:  # this prompt's failure is its own, not the batch's
                    self._release(request)
                    self._finish(request, "error", f"{type(exc).__name__}: {exc}")
                    continue
                self._advance(request, logits)
        if batch:
            self._decode(batch)

    def _decode(self, batch: list[_Request]) -> None:
        """One decode step of `batch`; greedy batches get tokens (and the next step launched
        ahead when every row wants more and no admission is pending)."""
        greedy = all(r.sampler.greedy for r in batch)
        more = all(r.params.max_new_tokens - len(r.output_ids) > 1 for r in batch)
        admitting = bool(self._waiting) and len(self._running) < self.runner.max_batch
        plan = StepPlan(tuple(r.slot for r in batch), tuple(r.output_ids[-1] for r in batch),
                        greedy=greedy, ahead=greedy and more and not admitting)
        out = self.runner.step(plan)
        self.decode_steps += 1
        self.decode_rows += len(batch)
        for row, request in enumerate(batch):
            if out.tokens is not None:
                self._advance(request, token=out.tokens[row])
            else:
                assert out.logits is not None
                self._advance(request, out.logits[row])

    def _advance(self, request: _Request, logits: torch.Tensor | None = None,
                 token: int | None = None) -> None:
        """Takes `token` (or samples one from `logits`) for `request`, emits its text, and
        finishes it when it stops."""
        if token is None:
            assert logits is not None
            token = request.sampler(logits)
        request.output_ids.append(token)
        reason = None
        if token in self._eos and not request.ignore_eos:
            reason = "stop"
            piece = request.text.finish()
        else:
            piece = request.text.push(token)
            if request.text.stopped:
                reason = "stop"
            elif (len(request.output_ids) >= request.params.max_new_tokens
                  or self.runner.committed(request.slot) >= self.runner.max_seq_len):
                reason = "length"
                piece += request.text.finish()
        event = Event(piece, (token,), len(request.prompt_ids), len(request.output_ids), reason)
        if reason is not None:
            self._release(request)
        self._emit(request, event)

    def _release(self, request: _Request) -> None:
        with self._wake:
            self._running.remove(request)
        if request.slot >= 0:
            self.runner.free(request.slot)
            request.slot = -1

    def _finish(self, request: _Request, reason: str, error: str | None = None) -> None:
        event = Event("", (), len(request.prompt_ids), len(request.output_ids), reason, error)
        self._emit(request, event)

    def _emit(self, request: _Request, event: Event) -> None:
        try:
            request.sink(event)
        except Exception:  # a broken consumer loses its request, not the loop
            log.exception("a request's sink failed; the request is cancelled")
            request.cancelled = True
