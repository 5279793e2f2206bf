"""The graph device check's row (graph_device_row.py) on the CPU: which entries are checks and how
they are judged, a section that raises, and where two decode runs' tokens part."""

from __future__ import annotations

import pytest
import torch
from graph_device_row import (
    CompileLog,
    Row,
    compare_tokens,
    diverged,
    failures,
    section,
    verdict,
)


def test_verdicts_judge_flags_tolerances_and_errors() -> None:
    assert verdict("graph_eq_eager_b1_d0", True) is True
    assert verdict("llm_uses_graphs", False) is False
    assert verdict("graph_vs_eager_max_dlogit_b1_d0", 2e-3) is False  # same kernels: 1e-3
    assert verdict("graph_vs_eager_max_dlogit_b3_d0", 2e-3) is True  # other kernels: 0.05
    assert verdict("graph_vs_eager_max_dlogit_b1_buckets", 2e-3) is False
    assert verdict("graph_vs_torch_reference_max_dlogit", 0.7) is None  # printed only
    assert verdict("bucket_compiles_b1", 2) is None
    assert verdict("error_buckets", "RuntimeError: x") is False
    row = {"graph_buckets_no_compile": False, "bucket_compiles_b1": 2,
           "fused_vs_module_max_dlogit_b1_d0": 0.06, "graph_eq_plain_tokens": True}
    assert failures(row) == {"graph_buckets_no_compile": False,
                             "fused_vs_module_max_dlogit_b1_d0": 0.06}


def test_a_section_that_raises_is_recorded_and_the_row_goes_on() -> None:
    row: Row = {}
    with section(row, "buckets"):
        row["graph_buckets_eq_eager_b1"] = True
        raise RuntimeError("compiled step failed")
    with section(row, "abort"):
        row["graph_recovers_after_abort"] = True
    assert row["error_buckets"] == "RuntimeError: compiled step failed"
    assert row["graph_recovers_after_abort"] is True
    assert set(row) >= {"seconds_buckets", "seconds_abort"}
    assert "error_abort" not in row
    with pytest.raises(KeyboardInterrupt), section(row, "cut"):  # not an Exception: stops
        raise KeyboardInterrupt


def _run(tokens: list[list[int]], gaps: list[list[float]]) -> tuple[list[list[int]],
                                                                    list[torch.Tensor]]:
    """A decode run whose step i's logits put token tokens[r][i + 1] first by gaps[i][r]."""
    logits = []
    for i, row_gaps in enumerate(gaps):
        step = torch.zeros(len(tokens), 8)
        for r, gap in enumerate(row_gaps):
            step[r, tokens[r][i + 1]] = 1.0
            step[r, (tokens[r][i + 1] + 1) % 8] = 1.0 - gap
        logits.append(step)
    return tokens, logits


def test_diverged_names_the_step_and_the_reference_gap() -> None:
    want = _run([[3, 4, 5, 6], [1, 2, 2, 2]], [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    ours = _run([[3, 4, 5, 6], [1, 2, 3, 3]], [[0.5, 0.5], [0.5, 0.25], [0.5, 0.5]])
    assert diverged(ours, want) == "row 1 step 1: top-2 gap 0.5, max |Δlogit| up to it 1"
    row: Row = {}
    compare_tokens(row, "graph_eq_plain_tokens", ours, want)
    assert row == {"graph_eq_plain_tokens": False,
                   "graph_eq_plain_tokens_diverged": diverged(ours, want)}
    compare_tokens(row, "graph_eq_eager_b1_d0", want, want)
    assert row["graph_eq_eager_b1_d0"] is True and "graph_eq_eager_b1_d0_diverged" not in row
    first = _run([[2, 4], [1, 2]], [[0.5, 0.5]])
    assert diverged(first, want) == "row 0: the prefill's token differs"


def test_compile_log_counts_compiles_by_the_graph_captured() -> None:
    from torch._dynamo.utils import counters

    class Runner:
        graphs: dict[tuple[int, int], object] = {(1, 64): None}

    runner = Runner()
    log = CompileLog(runner)
    counters["stats"]["unique_graphs"] += 2
    runner.graphs = {(1, 64): None, (1, 32): None}
    log()
    log()  # nothing new
    counters["stats"]["unique_graphs"] += 1
    log()
    assert log.by_graph == {"b1/w32": 2, "no capture": 1} and log.total == 3
