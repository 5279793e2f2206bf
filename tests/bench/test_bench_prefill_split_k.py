"""bench_prefill.py's `--split-k`: the counts it parses and refuses, and that each timed pass
streams exactly the k asked for (capped at a layer's experts), the planner's pick set aside
only while that k is timed; and "auto"'s untimed passes, run until its tuner settles
(`measure.settle_prefill`, which bench_gpu_experts.py runs too)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
from bench_script import load_script

from hetmoe.bench import measure
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.placement.expert_split import EXPLORE_PASSES, SplitCosts


@pytest.fixture(scope="module")
def script() -> Any:
    return load_script("engine/bench_prefill.py")


def checked(script: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split-k", default="")
    for name in ("--model", "--shape", "--num-layers", "--weight-format", "--group"):
        parser.add_argument(name)
    parser.add_argument("--ubatch", type=int, default=512)
    parser.add_argument("--modes", default="auto")
    args = parser.parse_args(argv)
    script.check_args(parser, args)
    return args


def test_split_k_counts_are_parsed_and_checked(script: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert checked(script, ["--split-k", "96,104,128"]).split_k == [96, 104, 128]
    assert checked(script, []).split_k == []
    with pytest.raises(SystemExit):
        checked(script, ["--split-k", "96,lots"])
    assert "--split-k takes comma-separated expert counts, got '96,lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        checked(script, ["--split-k", "-1"])
    assert "--split-k counts must be >= 0, got [-1]" in capsys.readouterr().err


def test_split_k_row_times_each_k_forced(script: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    planner = PrefillPlanner(128, 8, 2, refusal=lambda: "")
    runner = SimpleNamespace(planner=planner)
    passes: list[int] = []

    def prefill_speed(run: Any, n: int, vocab: int, repeats: int) -> float:
        k = run.planner.gpu_experts(n)  # what a pass of the runner would stream
        passes.append(k)
        return 1000.0 + k

    monkeypatch.setattr(script.measure, "prefill_speed", prefill_speed)
    row: dict[str, Any] = {}
    script.split_k_row(runner, row, 512, [0, 100, 200], 32000, 2)
    assert row["split_k_tok_s"] == {0: 1000.0, 100: 1100.0, 200: 1128.0}
    assert passes == [0, 0, 100, 100, 128, 128]  # a warm-up pass, then the timed one, per k
    with pytest.raises(RuntimeError, match="prefill_experts='auto' plans with this machine's"):
        planner.gpu_experts(512)  # the planner's own pick is back (no costs loaded here)


def test_auto_warms_up_until_its_tuner_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    costs = SplitCosts(cpu_fixed=6.724e-05, cpu_token=2.472e-06, gpu_expert=5.872e-05,
                       gpu_token=5.914e-08, gpu_fixed=5.589e-05, cpu_call=1.159e-05,
                       split_fixed=1.159e-05, split_token=1.556e-07)
    planner = PrefillPlanner(128, 8, 2, costs, refusal=lambda: "")
    runner = SimpleNamespace(planner=planner)
    passes: list[int] = []

    def prefill_speed(run: Any, n: int, vocab: int, repeats: int) -> float:
        k = run.planner.gpu_experts(n)
        passes.append(k)
        run.planner.tuner.record(n, k, n * (0.15 + 0.001 * abs(k - 106)))  # least at 106
        return 1000.0

    monkeypatch.setattr(measure, "prefill_speed", prefill_speed)
    done = measure.settle_prefill(runner, 512, 32000)
    assert done == len(passes) < EXPLORE_PASSES  # no climb: fewer passes than the bound
    assert planner.tuner.settled(planner.tuner.bucket(512)) and planner.gpu_experts(512) == 106
    passes.clear()
    assert measure.settle_prefill(runner, 8, 32000) == 1 and len(passes) == 1  # the model decides
