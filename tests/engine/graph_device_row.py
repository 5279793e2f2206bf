"""A row of the graph device checks (graph_device_checks.py): each entry's verdict and tolerance,
sections that record an exception and let the row go on, where two decode runs' tokens part, and
compiles counted per window bucket. The test and the script judge a row by `failures`."""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.utils import counters

Row = MutableMapping[str, object]
"""A family's checks and measurements by name (graph_device_checks.py `check_family`)."""
Decoded = tuple[list[list[int]], list[torch.Tensor]]
"""A greedy decode's tokens per row (the prefill's first) and [B, V] logits per step."""

SAME_KERNELS_ATOL = 1e-3
"""fp32, the same kernels on both sides: rounding only."""
OTHER_KERNELS_ATOL = 0.05
"""fp32, different kernels (batch 3 eagerly vs padded to 4 in the graph; fused vs HF layers):
their last-ulp differences can flip the bf16 rounding of a CPU expert's input (the CPU kernels
round activations to bf16), which moves logits by ~1e-2; tokens must still be equal."""


def tolerance(key: str) -> float:
    """The |Δlogit| allowed for a `max_dlogit` entry of a row."""
    same = key.startswith("graph_vs_eager_max_dlogit_b1")
    return SAME_KERNELS_ATOL if same else OTHER_KERNELS_ATOL


def verdict(key: str, value: object) -> bool | None:
    """Whether a row entry passes; None for a measurement. Checks: the `graph_*` and `llm_*`
    flags, each `max_dlogit` within its `tolerance` (against the torch-experts reference: printed
    only, its experts do not round to bf16), and no `error_*` (a section that raised)."""
    if key.startswith("error_"):
        return False
    if isinstance(value, bool) and key.startswith(("graph_", "llm_")):
        return value
    if "max_dlogit" in key and "torch_reference" not in key and isinstance(value, float):
        return value <= tolerance(key)
    return None


def failures(row: Row) -> dict[str, object]:
    """The entries of `row` that fail, with their values."""
    return {k: v for k, v in row.items() if verdict(k, v) is False}


@contextmanager
def section(row: Row, name: str) -> Iterator[None]:
    """Runs a part of a family's checks: an exception is recorded as `error_<name>` (with its
    traceback printed) and the row goes on; its wall time goes to `seconds_<name>`."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:  # the row reports it as a failure: nothing is lost
        traceback.print_exc()
        row[f"error_{name}"] = f"{type(exc).__name__}: {exc}"[:500]
    row[f"seconds_{name}"] = round(time.perf_counter() - start, 1)


def max_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def diverged(ours: Decoded, want: Decoded) -> str:
    """Where the tokens of two decode runs first differ: the step, the top-2 logit gap of `want`
    there (a near-tie flips on rounding noise, a fault flips a decisive token) and the largest
    |Δlogit| up to that step."""
    (tokens, logits), (want_tokens, want_logits) = ours, want
    first = min((i, r) for r, (a, b) in enumerate(zip(tokens, want_tokens, strict=True))
                for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    step, row = first[0] - 1, first[1]  # token i + 1 is step i's argmax
    if step < 0:
        return f"row {row}: the prefill's token differs"
    top = want_logits[step][row].topk(2).values
    before = max_delta(logits[: step + 1], want_logits[: step + 1])
    return (f"row {row} step {step}: top-2 gap {(top[0] - top[1]).item():.3g}, max |Δlogit| up "
            f"to it {before:.3g}")


def compare_tokens(row: Row, key: str, ours: Decoded, want: Decoded) -> None:
    """row[key]: the two runs' tokens are equal; if not, also `<key>_diverged` (`diverged`)."""
    equal = ours[0] == want[0]
    row[key] = equal
    if not equal:
        row[f"{key}_diverged"] = diverged(ours, want)


class CompileLog:
    """Dynamo compiles during a decode run, by the (batch size, window bucket) whose graph the
    step that compiled captured: call it after each step (`decode`'s `after_step`)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.seen = set(runner.graphs)
        self.count = counters["stats"]["unique_graphs"]
        self.by_graph: dict[str, int] = {}

    def __call__(self) -> None:
        new = sorted(set(self.runner.graphs) - self.seen)
        self.seen.update(new)
        now = counters["stats"]["unique_graphs"]
        if now > self.count:
            name = ",".join(f"b{size}/w{width}" for size, width in new) or "no capture"
            self.by_graph[name] = self.by_graph.get(name, 0) + now - self.count
        self.count = now

    @property
    def total(self) -> int:
        return sum(self.by_graph.values())
