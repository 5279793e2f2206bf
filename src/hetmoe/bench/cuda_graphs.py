"""A callable captured as one CUDA graph, and GPU time per call by CUDA events: the steps the
kernel tests and benchmark scripts share (warm up, capture, keep the static output, replay and
time). The engine's decode graphs (engine/executor/graphs.py) capture in parts around CPU jobs
and keep their own code."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Out = TypeVar("Out")


def _check(what: str, least: dict[str, int], **counts: int) -> None:
    """Refuses a count below its `least` value, then a host without CUDA: before fn runs."""
    for name, count in counts.items():
        if not isinstance(count, int) or count < least[name]:
            raise ValueError(f"{what}: {name} must be an integer >= {least[name]}, got {count!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU; torch sees none")


def capture(fn: Callable[[], Out], warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Out]:
    """`fn` captured as one CUDA graph -> (the graph, fn's output in the capture: the static
    tensors every replay writes again; new inputs go into the tensors fn reads, copied in place).

    First `warmup` calls of fn run outside the capture: a first call compiles its Triton kernels
    (host syncs, module loads) and creates library handles and workspaces, none of which may
    happen inside a capture. They run on a side stream, as torch's capture recipe warms up (the
    capture itself runs on a side stream), which first waits for the work queued so far; the
    current stream then waits for them, so the capture starts after their writes. `warmup=0`:
    the caller has warmed fn up itself (e.g. a torch.compile'd step, on the current stream)."""
    _check("capture", {"warmup": 0}, warmup=warmup)
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def event_ms(fn: Callable[[], object], repeats: int, warmup: int = 0) -> list[float]:
    """GPU milliseconds of each of `repeats` calls of fn (e.g. a graph's `replay`), in order.

    Each call sits between two CUDA events on the current stream and is waited for before the
    next one starts: one call's time from an idle GPU, not a pipelined mean (back-to-back calls
    would hide launch gaps behind the previous call's work). `warmup` untimed calls first, then a
    device synchronize, so the first timed call does not queue behind them. The caller picks the
    statistic (median, best)."""
    _check("event_ms", {"repeats": 1, "warmup": 0}, repeats=repeats, warmup=warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
