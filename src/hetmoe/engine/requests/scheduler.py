"""The generation loop: continuous batching over the runner's KV slots and decode steps.

The only loop of the engine: `LLM.generate / stream / chat` run it synchronously in the caller's
thread (`run_once` until their request ends), the server on a thread of its own. Each step it
admits waiting requests into free KV slots (the rest wait in order, never fail, until slots are
freed) and sends the runner ONE plan (`runner.step(StepPlan)`): prompt chunks of the requests
being prefilled, at most `EngineConfig.prefill_chunk` prompt tokens in all (a long prompt stalls
the running streams one chunk at a time; with nothing decoding the first takes its whole
prompt), run as rows of one forward pass; then a decode row for every other active sequence in
ONE batched step, so each expert's weights are read once per pass for the whole batch; a batch
of greedy requests that want no logits (no logprobs, penalty or `response_format`) gets tokens,
with the next step launched ahead by the runner while nothing is being prefilled. Each request
keeps its own sampler (seed, penalties, format constraint) and stop strings; EOS, stop strings,
`max_new_tokens` and a full context window end it here and nowhere else. A request of `n`
choices is prefilled once and its KV copied into the other choices' slots. Log-probabilities
come from the step's logits (one log_softmax for the rows that asked). Outputs leave through
each request's `sink` callback (on the loop's thread); `cancel()` frees the slots at the next
step.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hetmoe.engine.requests.constrained import Constraints, compile_format
from hetmoe.engine.requests.logprobs import TokenLogprob, token_logprobs
from hetmoe.engine.requests.prefix_cache import PrefixCache
from hetmoe.engine.requests.prompt_fill import PromptFill
from hetmoe.engine.requests.request import Event, QueueFull, Request, choices
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.step import StepPlan

if TYPE_CHECKING:
    import torch

    from hetmoe.engine.executor.runner import ModelRunner

log = logging.getLogger(__name__)


class Scheduler:
    """Admission, the batched decode loop and per-request stopping over a `ModelRunner`.

    While a scheduler runs, it is the only user of the runner and its KV-cache slots.
    """

    def __init__(self, runner: ModelRunner, decode_text: Callable[[list[int]], str],
                 eos_token_ids: Sequence[int] | frozenset[int], max_queue: int = 64,
                 threaded: bool = True, prefix_cache: bool = True,
                 constraints: Constraints | None = None) -> None:
        """`threaded`: run the loop on a thread of its own (a server); else the caller drives it
        with `run_once`. `prefix_cache`: reuse earlier requests' KV
        (engine/requests/prefix_cache.py).
        `constraints`: compiles requests' `response_format` (None: such requests are refused)."""
        self.runner = runner
        self.constraints = constraints
        self.prefix = PrefixCache(runner.cache, prefix_cache)
        self.max_queue = max_queue
        self._decode_text = decode_text
        self._eos = frozenset(eos_token_ids)
        self._waiting: collections.deque[Request] = collections.deque()  # first choices
        self._running: list[Request] = []
        self.fill = PromptFill(self)  # first choices whose prompt is being prefilled
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
        """Requests (choices) submitted but not yet admitted to a slot."""
        return sum(len(r.group) for r in self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def alive(self) -> bool:
        """True while the loop accepts and serves requests."""
        running = self._thread is None or self._thread.is_alive()
        return running and not self._stopped

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Event], None], ignore_eos: bool = False, fit_window: bool = True,
               n: int = 1) -> RequestHandle:
        """Queues a request of `n` choices (each its own event stream, `Event.index`);
        QueueFull at the queue limit, ValueError for an empty prompt, one beyond the context
        window, more choices than KV slots, or a `response_format` that cannot be followed.

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
        if not 1 <= n <= self.runner.max_batch:
            raise ValueError(f"n={n} choices need as many KV slots; there are "
                             f"{self.runner.max_batch} (max_batch)")
        fmt = compile_format(self.constraints, params.response_format)
        group = choices(list(prompt_ids), params, sink, self._decode_text, ignore_eos, n, fmt)
        with self._wake:
            if self._stopped:
                raise RuntimeError("the scheduler is stopped")
            # Requests that will have to wait for a slot: the queue proper.
            queued = self.num_waiting + len(self._running) - self.runner.max_batch
            if queued >= self.max_queue:
                raise QueueFull(
                    f"all {self.runner.max_batch} slots are busy and {queued} requests wait "
                    f"already (max_queue={self.max_queue})"
                )
            self._waiting.append(group[0])
            self._wake.notify()
        return RequestHandle(group, self)

    def stop(self) -> None:
        """Ends the loop; waiting and running requests finish as `cancelled`."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._drain()

    def _cancel(self, requests: list[Request]) -> None:
        with self._wake:
            for request in requests:
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
        """One step of the loop: admissions and prefills, then one batched decode step."""
        with self._wake:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                for choice in request.group:
                    self._finish(choice, "cancelled")
            admitted: list[Request] = []
            slots = self.runner.max_batch
            while self._waiting and len(self._running) + len(self._waiting[0].group) <= slots:
                admitted.append(self._waiting.popleft())
                self._running.extend(admitted[-1].group)
        try:
            self._step(admitted)
        except Exception as exc:  # a failed batched decode fails its rows, never the loop
            log.exception("a decode step failed")
            for request in list(self._running):
                self._release(request, failed=True)
                self._finish(request, "error", f"{type(exc).__name__}: {exc}")

    def _drain(self) -> None:
        for request in list(self._running):
            self._release(request)
            self._finish(request, "cancelled")
        for request in self._waiting:
            for choice in request.group:
                self._finish(choice, "cancelled")
        self._waiting.clear()

    def _step(self, admitted: list[Request]) -> None:
        """ONE runner step: prompt chunks of the placed requests under the token budget, and a
        decode row for every sequence past its prefill."""
        for request in [r for r in self._running if r.cancelled]:
            self._release(request)
            self._finish(request, "cancelled")
        batch = [r for r in self._running if r.output_ids]  # sequences past their prefill
        for request in admitted:
            if request in self._running:  # not cancelled meanwhile
                self.fill.place(request)
        fills = self.fill.chunks(bool(batch))
        if not batch and not fills:
            return
        # Tokens, not logits, when no row needs them; the next step launched ahead only when
        # it will be the same rows (every row wants more, nothing admitted or being prefilled).
        greedy = bool(batch) and not any(r.sampler.needs_logits for r in batch)
        more = all(r.params.max_new_tokens - len(r.output_ids) > 1 for r in batch)
        admitting = bool(self._waiting) and (
            len(self._running) + len(self._waiting[0].group) <= self.runner.max_batch)
        plan = StepPlan(tuple(r.slot for r in batch), tuple(r.output_ids[-1] for r in batch),
                        greedy=greedy, ahead=greedy and more and not admitting
                        and not self.fill.requests, prefills=tuple(chunk for _, chunk in fills))
        out = self.runner.step(plan)
        for (first, chunk), logits in zip(fills, out.prefill_logits, strict=True):
            self.fill.prefilled(first, chunk, logits)
        if batch:
            self.decode_steps += 1
            self.decode_rows += len(batch)
            self._sample(batch, out.logits, out.tokens)

    def _fail(self, group: list[Request], exc: Exception) -> None:
        for request in group:
            self._release(request, failed=True)
            self._finish(request, "error", f"{type(exc).__name__}: {exc}")

    def _sample(self, batch: list[Request], logits: torch.Tensor | None,
                tokens: Sequence[int] | None,
                scored: tuple[TokenLogprob | None, ...] | None = None) -> None:
        """Each row's token (the step's, or drawn from logits [B, V]), its log-probability for
        the rows that asked (one log_softmax over them), then `_advance`."""
        if tokens is None:
            assert logits is not None
            tokens = [r.sampler(logits[row]) for row, r in enumerate(batch)]
        asked = [row for row, r in enumerate(batch) if r.params.logprobs is not None]
        found: dict[int, TokenLogprob] = {}
        if asked:
            assert logits is not None
            picked = logits if len(asked) == len(batch) else logits[asked]
            tops = [batch[row].params.logprobs or 0 for row in asked]
            computed = token_logprobs(picked, [tokens[row] for row in asked], tops)
            found = dict(zip(asked, computed, strict=True))
        for row, request in enumerate(batch):
            self._advance(request, tokens[row], found.get(row), scored)

    def _advance(self, request: Request, token: int, logprob: TokenLogprob | None = None,
                 scored: tuple[TokenLogprob | None, ...] | None = None) -> None:
        """Takes `token` for `request`, emits its text, and finishes it when it stops."""
        request.sampler.observe(token)
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
        event = Event(piece, (token,), len(request.prompt_ids), len(request.output_ids), reason,
                      index=request.index, logprobs=(logprob,) if logprob is not None else (),
                      prompt_logprobs=scored, cached_tokens=request.cached_tokens)
        if reason is not None:
            self._release(request)
        self._emit(request, event)

    def _release(self, request: Request, failed: bool = False) -> None:
        """Frees the request's slot; its KV stays for the prefix cache unless it `failed`."""
        with self._wake:
            self._running.remove(request)
        if request.slot >= 0:
            self.runner.free(request.slot)
            held = None if failed else request.prompt_ids[:request.filled] + request.output_ids
            self.prefix.release(request.slot, held)
            request.slot = -1

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        event = Event("", (), len(request.prompt_ids), len(request.output_ids), reason, error,
                      index=request.index, cached_tokens=request.cached_tokens)
        self._emit(request, event)

    def _emit(self, request: Request, event: Event) -> None:
        try:
            request.sink(event)
        except Exception:  # a broken consumer loses its request, not the loop
            log.exception("a request's sink failed; the request is cancelled")
            request.cancelled = True


class RequestHandle:
    """The caller's side of a submitted request (all its choices)."""

    def __init__(self, requests: list[Request], scheduler: Scheduler) -> None:
        self._requests = requests
        self._scheduler = scheduler

    def cancel(self) -> None:
        """Stops generation; the slots and their KV cache are freed at the next step."""
        self._scheduler._cancel(self._requests)
