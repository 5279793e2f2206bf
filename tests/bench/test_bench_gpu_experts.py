"""benchmarks/engine/bench_gpu_experts.py's pair kernel A/B (`--pair-shapes`): each decode
setting runs once per launch shape, the shipped ones first, with the graphs captured again under
each and the shipped shapes back afterwards."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bench_script import load_script

from hetmoe.kernels.pair_config import (
    ONE_TOKEN_PAIR_CONFIGS,
    PAIR_CONFIGS,
    PairConfig,
    pair_config_for,
)

SCRIPT = load_script("engine/bench_gpu_experts.py")


class Runner:
    """What decode_rows uses of a ModelRunner: graph resets recorded."""

    def __init__(self) -> None:
        self.fused, self.placement, self.policy = None, None, None
        self.resets: list[tuple[Any, ...]] = []
        self.cache = SimpleNamespace(allocate=lambda: 0, free=lambda slot: None)

    def reset_graphs(self, *args: Any) -> None:
        self.resets.append(args)

    def prefill_logits(self, slot: int, ids: list[int]) -> torch.Tensor:
        return torch.zeros(len(ids), 4)  # the first run's, kept as the tokens' reference


def test_each_decode_setting_runs_per_shape_the_shipped_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shipped, one = PAIR_CONFIGS["int4"], ONE_TOKEN_PAIR_CONFIGS["int4"]
    other = PairConfig(32, 1, 64, 1, 4, 2, 4, True, True)
    seen: list[tuple[PairConfig, PairConfig]] = []

    def decode(runner: Runner, prompt: list[int], new_tokens: int) -> Any:
        # what a graph captured now would launch, at 1 and at 8 tokens
        seen.append((pair_config_for("int4", 1), pair_config_for("int4", 8)))
        return SimpleNamespace(tokens=[1, 2, 3], tok_s=200.0 + len(seen), mean_tok_s=1.0)

    monkeypatch.setattr(SCRIPT.measure, "greedy_decode", decode)
    args = argparse.Namespace(decode_kernels="", defer_orders="misses", deferred="0,3",
                              intervals="0", new_tokens=4, weight_format="int4")
    runner = Runner()
    rows = SCRIPT.decode_rows(runner, SimpleNamespace(everything=True), args, [1], [],
                              [other])
    assert seen == [(one, shipped), (other, other), (one, shipped), (other, other)]
    # a row names the shape one token launches (decode at batch 1)
    assert [(r["deferred"], r["pair_config"], r["pair_config_shipped"], r["tok_s"])
            for r in rows] == [(0, list(vars(one).values()), True, 201.0),
                               (0, list(vars(other).values()), False, 202.0),
                               (3, list(vars(one).values()), True, 203.0),
                               (3, list(vars(other).values()), False, 204.0)]
    # captured again before every row, then once more for what follows (the shipped shape)
    assert runner.resets == [(0, "misses"), (0, "misses"), (3, "misses"), (3, "misses"), ()]
    assert PAIR_CONFIGS["int4"] is shipped and ONE_TOKEN_PAIR_CONFIGS["int4"] is one


def test_the_shipped_shape_is_back_after_a_failed_run() -> None:
    shipped = PAIR_CONFIGS["int8"]
    with pytest.raises(RuntimeError, match="capture failed"):
        with SCRIPT.pair_config("int8", PairConfig(16, 1, 64, 1, 4, 4, 4)) as fields:
            assert fields == (16, 1, 64, 1, 4, 4, 4, False, False)
            raise RuntimeError("capture failed")
    assert PAIR_CONFIGS["int8"] is shipped


def test_a_bad_shape_stops_the_run_before_the_model_is_built(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_gpu_experts.py")
    assert SCRIPT.pair_shapes([], parser) == []
    assert SCRIPT.pair_shapes(["16,2,64,3,4,4,4,1"], parser) == [PAIR_CONFIGS["int8"]]
    with pytest.raises(SystemExit):
        SCRIPT.pair_shapes(["16,1,128,4,4,4,8,1", "16,1,128,4,4,4,3"], parser)
    assert ("--pair-shapes: PairConfig: warps_down must be one of 1, 2, 4, 8, got 3"
            in capsys.readouterr().err)


def test_the_recorded_command_reruns_the_same_run() -> None:
    argv = ["--budgets", "0,all", "--pair-shapes", "32,1,64,1,4,2,4,1,1", "16,2,64,3,4,4,4,1",
            "--profile", "--json", "out.json"]
    args = SCRIPT.parse_args(argv)
    assert args.command == (
        "benchmarks/engine/bench_gpu_experts.py --shape qwen3-30b-a3b --weight-format int8 "
        "--budgets 0,all --deferred 0 --defer-orders misses --intervals 0 --prefill-modes "
        "auto,cpu --prefill-repeats 2 --pair-shapes 32,1,64,1,4,2,4,1,1 16,2,64,3,4,4,4,1 "
        "--profile --new-tokens 128 --prompt-len 32 --json out.json")
    again = SCRIPT.parse_args(args.command.split()[1:])
    assert vars(again) == vars(args)
    assert args.budget_list == ["0", "all"] and args.shapes[1] == PAIR_CONFIGS["int8"]
    # no --pair-shapes given: none recorded (an empty list is not an option's value)
    assert "--pair-shapes" not in SCRIPT.parse_args([]).command


def test_bad_budgets_stop_the_run_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        SCRIPT.parse_args(["--budgets", "8,-1"])
    assert capsys.readouterr().err.strip().endswith(
        "error: --budgets takes GB >= 0 or all, got '-1' in '8,-1'")
