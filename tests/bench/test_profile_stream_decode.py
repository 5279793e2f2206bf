"""benchmarks/engine/profile_stream_decode.py: its chrome-trace summary over a written trace (per
step medians: busy streams, compute idle gaps, host-to-device bytes and rate, kernel and runtime
tables) and `profiled` under a real torch.profiler on the CPU (a stand-in decode step), which
exports its trace after the profiler stopped once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_script import load_script

SCRIPT = load_script("engine/profile_stream_decode.py")


def _x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def _step(t0: float, gap: float) -> list[dict[str, Any]]:
    """One 1000 us `graph` step: kernels of 100 + 200 us on stream 7 `gap` us apart, a 50 us
    kernel on stream 9, a 4 MB host-to-device copy of 40 us on stream 9, one runtime sync."""
    return [_x("graph", "user_annotation", t0, 1000.0),
            _x("gemm", "kernel", t0 + 10, 100.0, stream=7),
            _x("gemm", "kernel", t0 + 110 + gap, 200.0, stream=7),
            _x("copy_k", "kernel", t0 + 20, 50.0, stream=9),
            _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", t0 + 100, 40.0, stream=9,
               bytes=4e6),
            _x("cudaStreamSynchronize", "cuda_runtime", t0 + 5, 300.0)]


def test_trace_summary_gives_per_step_medians(tmp_path: Path) -> None:
    events = _step(0.0, 10.0) + _step(2000.0, 50.0) + _step(4000.0, 90.0)
    events.append({"ph": "i", "name": "marker", "ts": 1.0})  # not a span: ignored
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    r = SCRIPT.trace_summary(trace, "graph", layers=2)
    assert r["step_ms"] == pytest.approx(1.0)
    assert r["compute_busy_ms"] == pytest.approx(0.3)
    # Gaps of 10 us are launch spacing (< GAP_US); the median step's 50 us gap is idle.
    assert r["gaps"] == 1 and r["compute_idle_ms"] == pytest.approx(0.05)
    assert r["idle_us_per_layer"] == pytest.approx(25.0)
    assert r["largest_gaps_us"] == [pytest.approx(50.0)]
    assert r["streams_busy_ms"] == {"7": pytest.approx(0.3), "9": pytest.approx(0.09)}
    assert r["h2d_mb"] == pytest.approx(4.0) and r["h2d_busy_ms"] == pytest.approx(0.04)
    assert r["h2d_gb_s"] == pytest.approx(100.0)  # 4 MB in 40 us
    assert r["kernels"] == [("gemm", 2.0, 300.0), ("copy_k", 1.0, 50.0)]
    assert r["runtime"] == [("cudaStreamSynchronize", 1.0, 300.0)]


def test_union_us_counts_overlaps_once() -> None:
    assert SCRIPT.union_us([(0.0, 10.0), (5.0, 20.0), (30.0, 35.0)]) == 25.0
    assert SCRIPT.union_us([]) == 0.0


def test_profiled_traces_each_step_in_its_range(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []

    def decode(runner: object, slots: tuple[int, ...], tokens: tuple[int, ...], steps: int
               ) -> tuple[tuple[int, ...], float]:
        assert steps == 1
        calls.append(tokens)
        torch.randn(64, 64) @ torch.randn(64, 64)  # some CPU work inside the range
        return tuple(t + 1 for t in tokens), 0.0

    monkeypatch.setattr(SCRIPT, "decode", decode)
    tokens, r = SCRIPT.profiled(None, (0, 1), (5, 9), "stream", steps=3, layers=4)
    assert tokens == (8, 12) and calls == [(5, 9), (6, 10), (7, 11)]
    assert r["step_ms"] > 0
    # No GPU here: no kernels, copies or gaps in the ranges.
    assert r["kernels"] == [] and r["h2d_mb"] == 0 and r["gaps"] == 0
