"""bench/serve_report.py and bench_serve.py --plot: the concurrency sweep's series per budget
beside llama-batched-bench's (B·TG / T against our tok/s, S_TG against our decode tok/s), the
lines the PNG holds, and runs from before the sweep read as one budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from batched_bench_sample import MARKDOWN
from bench_script import load_script
from matplotlib.figure import Figure

from hetmoe.bench.batched_bench import parse_batched_bench
from hetmoe.bench.serve_report import plot, series, sweep_points, table

OURS = "hetmoe INT8, {} GiB experts on GPU (prompt 32, 48 new)"
PEER = "llama.cpp (prompt 32, 48 new)"


def point(gib: float, streams: int, tok_s: float, decode: float) -> dict[str, Any]:
    return {"budget_gib": gib, "gpu_expert_bytes": int(gib * 2**30), "streams": streams,
            "tok_s": tok_s, "decode_tok_s": decode, "ttft_s": 0.5, "ttft_p50_s": 0.4}


def sweep_result() -> dict[str, Any]:
    """A bench_serve.py sweep cut by its deadline: 15 GiB reached 2 streams."""
    return {"config": {"shape": "qwen3-30b-a3b", "model": None, "weight_format": "int8",
                       "prompt_len": 32, "new_tokens": 48},
            "machine": {"gpu_name": "NVIDIA H100 80GB HBM3"}, "date": "2026-11-28",
            "points": [point(0, 1, 40.0, 50.0), point(0, 4, 80.0, 100.0),
                       point(0, 2, 60.0, 70.0), point(15, 1, 45.0, 66.0),
                       point(15, 2, 70.0, 90.0)],
            "stopped": "--deadline 300 s: before 15 GiB, 4 streams"}


def test_series_pair_like_with_like() -> None:
    peer = parse_batched_bench(MARKDOWN)
    drawn = series(sweep_result(), {"llama.cpp": peer})
    assert list(drawn["output"]) == [f"{OURS.format(0)}: tok_s", f"{OURS.format(15)}: tok_s",
                                     f"{PEER}: B·TG/T"]
    assert list(drawn["decode"]) == [f"{OURS.format(0)}: decode_tok_s",
                                     f"{OURS.format(15)}: decode_tok_s", f"{PEER}: S_TG"]
    assert drawn["output"][f"{OURS.format(0)}: tok_s"] == [(1, 40.0), (2, 60.0), (4, 80.0)]
    assert drawn["decode"][f"{OURS.format(15)}: decode_tok_s"] == [(1, 66.0), (2, 90.0)]
    theirs = drawn["output"][f"{PEER}: B·TG/T"]
    assert [n for n, _ in theirs] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert theirs[-1][1] == pytest.approx(256 * 48 / 41.023)  # not S = 499.23 nor S_TG
    assert drawn["decode"][f"{PEER}: S_TG"][-1] == (256, 351.98)
    text = table(drawn).splitlines()
    assert text[0] == f" output | {OURS.format(0)}: tok_s | 1: 40.0  2: 60.0  4: 80.0"
    assert len(text) == 6


def test_the_png_holds_the_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures: list[Figure] = []
    real_savefig = Figure.savefig

    def keep(fig: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(fig)
        real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    png = tmp_path / "serve.png"
    drawn = plot(sweep_result(), {"llama.cpp": parse_batched_bench(MARKDOWN)}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    for ax, panel in zip(fig.axes, ("output", "decode"), strict=True):
        lines = {line.get_label(): [tuple(xy) for xy in np.asarray(line.get_xydata())]
                 for line in ax.get_lines()}
        assert lines == drawn[panel]
        assert ax.get_xscale() == "log"
        assert ax.xaxis.get_transform().base == 2  # type: ignore[attr-defined]
        legend = ax.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == list(drawn[panel])


def test_a_run_from_before_the_sweep_reads_as_one_budget() -> None:
    earlier = {"config": {"gpu_expert_gib": 15.0, "prompt_len": 32, "new_tokens": 48,
                          "weight_format": "int8"},
               "together": {"1": {"tok_s": 43.7, "decode_tok_s": 66.1},
                            "32": {"tok_s": 210.3, "decode_tok_s": 219.6}}}
    assert [(p["budget_gib"], p["streams"], p["tok_s"]) for p in sweep_points(earlier)] == [
        (15.0, 1, 43.7), (15.0, 32, 210.3)]
    assert series(earlier, {})["output"] == {f"{OURS.format(15)}: tok_s": [(1, 43.7),
                                                                           (32, 210.3)]}
    with pytest.raises(ValueError, match="not a bench_serve.py result: it has neither 'points' "
                                         "nor 'together'"):
        sweep_points({"rows": []})


def test_bench_serve_plot_from_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = load_script("serving/bench_serve.py")
    result, peer = tmp_path / "serve.json", tmp_path / "batched_bench.md"
    result.write_text(json.dumps(sweep_result()))
    peer.write_text(MARKDOWN)
    png = tmp_path / "serve.png"
    module.main(["--json", str(result), "--plot", str(png), "--peer", str(peer),
                 "--peer", f"llama.cpp -ncmoe 24={peer}"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in out if line.startswith(" output")] == [
        f"{OURS.format(0)}: tok_s", f"{OURS.format(15)}: tok_s", f"{PEER}: B·TG/T",
        "llama.cpp -ncmoe 24 (prompt 32, 48 new): B·TG/T"]
