"""benchmarks/engine/bench_gpu_experts.py: a decode run whose tokens part from the first run's
(budget 0) records where, with the first run's top-2 logit gap there (graph_device_row's
`diverged`, the graph device checks' helper), so a device run tells a near-tie from a fault."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bench_script import load_script

SCRIPT = load_script("engine/bench_gpu_experts.py")

PROMPT = [7, 8]


class Runner:
    """What decode_rows uses of a ModelRunner, with canned teacher-forced logits per call."""

    def __init__(self, logits: list[torch.Tensor]) -> None:
        self.fused, self.placement, self.policy = None, None, None
        self.logits, self.fed = logits, []  # [T, V] per prefill_logits call; its token ids
        self.cache = SimpleNamespace(allocate=lambda: 0, free=lambda slot: None)

    def reset_graphs(self, *args: Any) -> None:
        pass

    def prefill_logits(self, slot: int, ids: list[int]) -> torch.Tensor:
        self.fed.append(list(ids))
        return self.logits[len(self.fed) - 1]


def rows_of(step_logits: list[list[float]]) -> torch.Tensor:
    """[P + N - 1, V]: the prompt's positions (the last chose the prefill's token; unread),
    then the rows that chose tokens 1..N-1."""
    return torch.tensor([[0.0, 0.0, 0.0, 0.0]] * len(PROMPT) + step_logits)


def test_a_run_that_parts_records_the_first_runs_top2_gap_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = iter([[1, 2, 3, 0], [1, 2, 0, 0]])  # the second parts at token 2 (step 1's argmax)

    def decode(runner: Runner, prompt: list[int], new_tokens: int) -> Any:
        return SimpleNamespace(tokens=next(runs), tok_s=10.0, mean_tok_s=10.0)

    monkeypatch.setattr(SCRIPT.measure, "greedy_decode", decode)
    # base: step 0 chose 2 (gap 4.0), step 1 chose 3 by 0.25 over 0; ours chose 0
    base = rows_of([[1.0, 0.0, 5.0, 0.0], [2.0, 0.0, 0.0, 2.25], [9.0, 0.0, 0.0, 0.0]])
    ours = rows_of([[1.0, 0.0, 5.5, 0.0], [2.5, 0.0, 0.0, 2.0], [9.0, 0.0, 0.0, 0.0]])
    runner = Runner([base, ours])
    args = argparse.Namespace(decode_kernels="", defer_orders="misses", deferred="0,3",
                              intervals="0", new_tokens=4, weight_format="int8")
    rows = SCRIPT.decode_rows(runner, SimpleNamespace(everything=True), args, PROMPT, [], [])
    assert [r["tokens_equal_budget0_first"] for r in rows] == [4, 2]
    assert "budget0_diverged" not in rows[0]
    assert rows[1]["budget0_diverged"] == ("row 0 step 1: top-2 gap 0.25, max |Δlogit| up to "
                                           "it 0.5")
    # each run teacher-forced once: the prompt and every token but the last
    assert runner.fed == [[7, 8, 1, 2, 3], [7, 8, 1, 2, 0]]
