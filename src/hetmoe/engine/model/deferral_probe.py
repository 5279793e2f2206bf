"""The two measurements `--deferred auto` decides on (engine/model/deferral_auto.py), made on a
loaded runner before its first request: decode step times with and without the CPU experts' work,
and the KL between exact and deferred next-token distributions on a probe prompt.

Both use their own KV slot (freed after), so they leave no state behind but the captured graphs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

from hetmoe.engine.executor.runner import ModelRunner

WARMUP_STEPS = 2
"""Decode steps not timed: the first captures the step's CUDA graph, the second warms caches."""


def step_seconds(runner: ModelRunner, prompt: Sequence[int], steps: int) -> float:
    """Median seconds between two tokens read in `steps` greedy decode steps after `prompt` (the
    steps a greedy request runs; `WARMUP_STEPS` more before them, untimed)."""
    if len(prompt) + steps + WARMUP_STEPS > runner.max_seq_len:
        raise ValueError(f"deferred auto: the context window ({runner.max_seq_len} tokens) has no "
                         f"room for {steps} timed decode steps after a {len(prompt)}-token probe")
    slot = runner.cache.allocate()
    try:
        token = int(runner.prefill(slot, prompt).argmax())
        times: list[float] = []
        start = time.perf_counter()
        for i, _ in enumerate(runner.greedy(slot, token, limit=steps + WARMUP_STEPS)):
            now = time.perf_counter()
            if i >= WARMUP_STEPS:
                times.append(now - start)
            start = now
    finally:
        runner.free(slot)
    return statistics.median(times)


@contextlib.contextmanager
def without_cpu_experts(runner: ModelRunner) -> Iterator[None]:
    """Every routed expert masked out of the CPU jobs (they route nothing): what remains of a
    decode step is the GPU's work, the copies and the signals. Its tokens mean nothing."""
    assert runner.overlap is not None, "without_cpu_experts needs the cpu backend's experts"
    moes = runner.overlap.cpu
    for moe in moes:
        moe.set_gpu_experts(torch.ones(moe.num_experts, dtype=torch.bool))
    try:
        yield
    finally:
        for moe in moes:
            moe.set_gpu_experts(None)


class KLProbe:
    """Mean KL(exact || deferred) of the next-token distributions over `steps` decode steps after
    `prompt`: the exact run decodes greedily once (deferred=0); each `kl(d)` feeds the same tokens
    with `d` deferred experts (teacher-forced, so both see the same context). Prefill never
    defers, so the steps compared are decode steps only. Leaves the runner at deferred=0."""

    def __init__(self, runner: ModelRunner, prompt: Sequence[int], steps: int) -> None:
        if len(prompt) + steps > runner.max_seq_len:
            raise ValueError(f"deferred auto: a {len(prompt)}-token probe and {steps} decode "
                             f"steps exceed the context window ({runner.max_seq_len} tokens)")
        self.runner, self.prompt, self.steps = runner, list(prompt), steps
        self.tokens, self.exact = self._log_probs(0, None)

    def kl(self, deferred: int) -> float:
        """Mean KL in nats per decode step between exact and `deferred` decoding."""
        _, late = self._log_probs(deferred, self.tokens)
        # [steps, V] float64: sum_v p_exact (log p_exact - log p_deferred), then the mean.
        return float((self.exact.exp() * (self.exact - late)).sum(-1).mean())

    def _log_probs(self, deferred: int, tokens: list[int] | None
                   ) -> tuple[list[int], torch.Tensor]:
        """(the tokens fed, log-probabilities [steps, V] float64) of decode with `deferred`;
        tokens None: each step's greedy choice."""
        runner = self.runner
        runner.reset_graphs(deferred)
        slot = runner.cache.allocate()
        try:
            fed = [int(runner.prefill(slot, self.prompt).argmax())]
            rows = []
            for i in range(self.steps):
                token = fed[i] if tokens is None else tokens[i]
                logits = runner.decode([slot], [token])[0]  # [V] float32
                rows.append(torch.log_softmax(logits.double(), -1).cpu())
                fed.append(int(logits.argmax()))
        finally:
            runner.free(slot)
            runner.reset_graphs(0)
        return fed[: self.steps] if tokens is None else tokens, torch.stack(rows)
