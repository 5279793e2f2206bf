"""benchmarks/engine/bench_gpu_experts.py's prefill rows: "auto" first runs its tuner's passes
untimed (`measure.settle_prefill`), then times `repeats` passes of what it settled on, as the
other modes time theirs; the rows count the tuning passes and list the timed passes' k alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from bench_script import load_script

from hetmoe.bench import measure
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.placement.expert_split import EXPLORE_PASSES, SplitCosts

SCRIPT = load_script("engine/bench_gpu_experts.py")
COSTS = SplitCosts(cpu_fixed=6.724e-05, cpu_token=2.472e-06, gpu_expert=5.872e-05,
                   gpu_token=5.914e-08, gpu_fixed=5.589e-05, cpu_call=1.159e-05,
                   split_fixed=1.159e-05, split_token=1.556e-07)


def test_auto_is_timed_after_its_tuner_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    planner = PrefillPlanner(128, 8, 2, COSTS, refusal=lambda: "")
    runner = SimpleNamespace(planner=planner, config=EngineConfig())
    passes: list[tuple[str, int]] = []  # (mode, k) of every pass, tuning ones included

    def pass_s(n: int, k: int) -> float:
        return n * (0.15 + 0.001 * abs(k - 106))  # least at 106: a trial's k is slower

    def prefill_speed(run: Any, n: int, vocab: int, repeats: int) -> float:
        mode = run.config.prefill_experts
        ks = [run.planner.gpu_experts(n, mode) for _ in range(repeats)]
        for k in ks:
            passes.append((mode, k))
            if mode == "auto":
                run.planner.tuner.record(n, k, pass_s(n, k))
        return n / min(pass_s(n, k) for k in ks)

    monkeypatch.setattr(measure, "prefill_speed", prefill_speed)
    rows = SCRIPT.prefill_rows(runner, [512], ["auto", "cpu"], 2, 32000, False)
    auto, cpu = rows
    tuning = [k for mode, k in passes if mode == "auto"][:-2]
    assert 1 < auto["tuning_passes"] == len(tuning) < EXPLORE_PASSES
    assert set(tuning) != {106}  # the tuner tried other splits first, untimed
    assert auto["gpu_experts_per_pass"] == [106, 106]  # the timed passes: the settled k alone
    assert auto["tok_s"] == round(512 / pass_s(512, 106), 1)
    assert cpu["tuning_passes"] == 0 and cpu["gpu_experts_per_pass"] == [0, 0]
    assert [m for m, _ in passes].count("cpu") == 2  # cpu times its `repeats` passes only
    assert runner.config.prefill_experts == "auto"
    assert "gpu_experts" not in vars(planner)  # the planner's own method again
