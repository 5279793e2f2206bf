"""benchmarks/training/bench_sft.py on the baby qwen3_moe: the JSON's numbers agree with each
other, the trace holds both sides, the deadline cuts the timed steps, bad options are refused by
name."""

from __future__ import annotations

import gzip
import json
import math
import runpy
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "training" / "bench_sft.py"
TINY = ["--shape", "tiny", "--seq-len", "32", "--batch", "2", "--bandwidth-gib", "0.0625",
        "--warmup", "1", "--rate-repeats", "2"]


@pytest.fixture(scope="module")
def bench_main() -> Callable[[list[str]], dict[str, Any]]:
    main: Callable[[list[str]], dict[str, Any]] = runpy.run_path(str(SCRIPT))["main"]
    return main


def test_bench_sft_numbers_agree(bench_main: Callable[[list[str]], dict[str, Any]],
                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace" / "step.json.gz"
    r = bench_main([*TINY, "--steps", "3", "--out", str(tmp_path), "--trace", str(trace)])
    assert json.loads((tmp_path / "bench_sft.json").read_text()) == r
    assert "| step s | forward s |" in capsys.readouterr().out
    assert (r["device"], r["dtype"], r["layers"], r["moe_layers"]) == ("cpu", "float32", 2, 2)
    h, i, k = r["hidden"], r["expert_width"], r["top_k"]
    assert (h, i, k, r["experts"], r["tokens_per_step"]) == (64, 32, 4, 8, 64)
    assert len(r["warmup_steps"]) == 1 and len(r["steps"]) == 3
    for step in r["warmup_steps"] + r["steps"]:
        parts = step["forward_s"] + step["backward_s"] + step["optimizer_s"]
        assert step["step_s"] == pytest.approx(parts, abs=2e-5)
        assert math.isfinite(step["loss"]) and step["loss"] > 0
    assert r["step_s"] == pytest.approx(statistics.median(s["step_s"] for s in r["steps"]))
    assert r["tokens_per_s"] == pytest.approx(64 / r["step_s"], rel=1e-3)
    pairs = 64 * k
    for name, per_pair in (("forward", 6), ("backward", 10)):
        rate = r["expert_rate"][name]
        assert rate["flops_per_layer"] == per_pair * h * i * pairs
        assert rate["layer_s"] > 0
        assert rate["gflop_s"] == pytest.approx(rate["flops_per_layer"] / rate["layer_s"] / 1e9,
                                                rel=0.02, abs=0.1)
    floor = r["floor"]
    layer_s = r["expert_rate"]["forward"]["layer_s"] + r["expert_rate"]["backward"]["layer_s"]
    assert floor["seconds"] == pytest.approx(2 * layer_s, rel=1e-3, abs=1e-4)
    assert floor["flops_per_step"] == 2 * 16 * h * i * pairs
    assert r["of_floor"] == pytest.approx(floor["seconds"] / r["step_s"], rel=1e-2, abs=1e-3)
    assert 0 < r["of_floor"] < 1.5
    assert r["read_gb_s"] > 0 and r["trainable_params"] > 0
    memory = r["memory"]
    assert 0 < memory["host_rss_gib"] <= memory["host_peak_rss_gib"]
    assert "gpu_peak_allocated_gib" not in memory  # no GPU here
    assert r["deadline"] == {"seconds": None, "hit": False}
    assert r["machine"]["cores"] and r["git"]
    t = r["trace"]
    assert t["file"] == str(trace) and t["gpu_busy_s"] == 0 and t["both_busy_s"] == 0
    assert 0 < t["cpu_experts_busy_s"] <= t["profiled_step_s"]
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"cpu_experts fwd L0", "cpu_experts fwd L1", "RoutedExpertsBackward", "forward",
            "backward", "optimizer"} <= names


def test_bench_sft_deadline_keeps_one_step_and_skips_the_trace(
        bench_main: Callable[[list[str]], dict[str, Any]], tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    r = bench_main([*TINY, "--steps", "5", "--deadline", "0.01", "--out", str(tmp_path),
                    "--trace", str(trace)])
    assert len(r["steps"]) == 1 and r["deadline"] == {"seconds": 0.01, "hit": True}
    assert r["trace"] is None and not trace.exists()
    assert json.loads((tmp_path / "bench_sft.json").read_text())["deadline"]["hit"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq-len", "1"], "--seq-len must be >= 2, got 1"),
    (["--deadline", "0"], "--bandwidth-gib and --deadline must be > 0"),
    (["--trace", "trace.txt"], "--trace trace.txt: expected a file path ending in .json"),
    (["--shape", "qwen9"], "invalid choice: 'qwen9'"),
    (["--weight-format", "int2"], "invalid choice: 'int2'"),
])
def test_bench_sft_refuses_bad_options(bench_main: Callable[[list[str]], dict[str, Any]],
                                       tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        bench_main([*TINY, "--out", str(tmp_path), *extra])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench_sft.json").exists()


def test_bench_sft_refuses_a_sequence_past_the_shape(
        bench_main: Callable[[list[str]], dict[str, Any]], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--seq-len 300 exceeds shape tiny's "
                                         "max_position_embeddings 256"):
        bench_main([*TINY, "--seq-len", "300", "--out", str(tmp_path)])


def test_bench_sft_refuses_a_file_as_out(bench_main: Callable[[list[str]], dict[str, Any]],
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    out = tmp_path / "file"
    out.write_text("")
    with pytest.raises(SystemExit):
        bench_main([*TINY, "--out", str(out)])
    assert f"--out {out} is a file; give a directory" in capsys.readouterr().err
