"""benchmarks/kernels/bench_pool.py runs end to end and writes the JSON it promises (run
in-process: the machine report's torch/transformers imports are shared with the rest of the
suite)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "bench_pool.py"


def test_bench_pool_writes_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pool.json"
    argv = [str(SCRIPT), "--iters", "50", "--woken", "1", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    stdout = capsys.readouterr().out
    assert "median µs" in stdout and "python queue hand-off" in stdout
    result = json.loads(out.read_text())
    assert set(result["results"]) == {
        "empty job",
        f"small job ({4 * max(result['pool']['group_sizes'])} tasks/group)",
        "woken job (after park)",
        "python queue hand-off",
    }
    for row in result["results"].values():
        assert 0 < row["min_us"] <= row["median_us"] <= row["p90_us"]
    assert result["results"]["empty job"]["iters"] == 50
    assert result["ratio_queue_over_empty_job"] > 0
    assert result["machine"]["cores"]
