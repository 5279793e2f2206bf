"""benchmarks/serving/bench_serve.py's sweep on the baby qwen3_moe preset (CPU): every (budget,
streams) point on one build, the JSON rewritten after each point, the deadline and --wait-for
stopping it with the finished points kept, and its arguments checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_script import load_script

SCRIPT = "serving/bench_serve.py"
TINY = ["--model", "tiny-qwen3-moe", "--prompt-len", "8", "--new-tokens", "4"]


def test_sweep_rewrites_its_json_after_every_point(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_script(SCRIPT)
    out = tmp_path / "serve.json"
    snapshots: list[dict[str, Any]] = []
    real_write = module.write

    def recording(result: dict[str, Any], path: Path | None) -> None:
        real_write(result, path)
        assert path is not None
        snapshots.append(json.loads(path.read_text()))  # valid JSON on disk every time

    monkeypatch.setattr(module, "write", recording)
    module.main([*TINY, "--streams", "1,3", "--budgets", "0,0.001", "--json", str(out)])
    # Once before the first point, after each of the 4, once at the end.
    assert [len(s["points"]) for s in snapshots] == [0, 1, 2, 3, 4, 4]
    result = json.loads(out.read_text())
    assert result == snapshots[-1] and result["stopped"] is None
    points = result["points"]
    assert [(p["budget_gib"], p["streams"]) for p in points] == [(0, 1), (0, 3), (0.001, 1),
                                                                 (0.001, 3)]
    # Re-placed between budgets on the one build: 1 MiB holds some of the baby's experts.
    assert points[0]["gpu_expert_bytes"] == 0 and points[0]["gpu_share"] == 0
    assert points[2]["gpu_expert_bytes"] > 0 and points[2]["gpu_share"] > 0
    for p in points:
        assert p["tok_s"] * p["wall_s"] == pytest.approx(p["streams"] * 4, rel=1e-2)
        assert len(p["ttft_per_request_s"]) == p["streams"]
        assert 0 < p["ttft_p50_s"] <= p["ttft_s"] == max(p["ttft_per_request_s"])
    for one, three in (points[0:2], points[2:4]):
        assert one["x_one_stream"] == 1.0
        assert three["x_one_stream"] == pytest.approx(three["tok_s"] / one["tok_s"], abs=2e-3)
    assert result["config"]["budgets"] == [0.0, 0.001] and result["config"]["json"] == str(out)


def test_the_deadline_stops_before_a_point_and_keeps_the_done_ones(tmp_path: Path) -> None:
    module = load_script(SCRIPT)
    out = tmp_path / "serve.json"
    args = module.parse_args([*TINY, "--streams", "1,2", "--budgets", "0,0.001",
                              "--deadline", "30", "--json", str(out)])
    runner = module.build_runner(args, 2, 20)
    result: dict[str, Any] = {"points": [], "stopped": None}
    module.sweep(runner, args, result, lambda: len(result["points"]) == 3)
    assert result["stopped"] == "--deadline 30 s: before 0.001 GiB, 2 streams"
    written = json.loads(out.read_text())
    assert [(p["budget_gib"], p["streams"]) for p in written["points"]] == [(0, 1), (0, 2),
                                                                             (0.001, 1)]


def test_deadline_and_wait_for_from_the_command_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    module = load_script(SCRIPT)
    out = tmp_path / "serve.json"
    module.main([*TINY, "--streams", "1", "--deadline", "0", "--json", str(out)])
    result = json.loads(out.read_text())
    assert (result["points"], result["stopped"]) == ([], "--deadline 0 s: before 0 GiB, "
                                                         "1 streams")
    assert "stopped: --deadline 0 s" in capsys.readouterr().out
    never = tmp_path / "peer_ready"
    module.main([*TINY, "--streams", "1", "--wait-for", str(never), "--deadline", "0",
                 "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["stopped"] == f"--deadline 0 s: {never} never came" and result["points"] == []
    never.touch()
    module.main([*TINY, "--streams", "1", "--wait-for", str(never), "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["stopped"] is None and [p["streams"] for p in result["points"]] == [1]
    assert result["waited_s"] < 1.0 and result["config"]["wait_for"] == str(never)


@pytest.mark.parametrize(("argv", "message"), [
    (["--plot", "x.png"], "--plot draws the results of --json FILE, and none was given"),
    (["--streams", "1,0"], "numbers >= 1 expected, got '1,0'"),
    (["--budgets", "0,x"], "invalid parse value: '0,x'"),
])
def test_bad_arguments_are_named(argv: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_script(SCRIPT).parse_args(argv)
    assert message in capsys.readouterr().err


def test_stream_decode_settings_each_sweep_and_are_recorded(tmp_path: Path) -> None:
    module = load_script(SCRIPT)
    out = tmp_path / "serve.json"
    module.main([*TINY, "--streams", "2", "--stream-decode", "0,auto,4", "--warmup-tokens", "2",
                 "--json", str(out)])
    points = json.loads(out.read_text())["points"]
    # On the CPU device nothing streams: the rows stay None (never) whatever the setting.
    assert [(p["stream_decode_rows"], p["streams"], p["decode_rows"], p["decode_ks"])
            for p in points] == [(0, 2, None, {}), ("auto", 2, None, {}), (4, 2, None, {})]
    with pytest.raises(SystemExit):
        module.parse_args([*TINY, "--stream-decode", "0,always"])
