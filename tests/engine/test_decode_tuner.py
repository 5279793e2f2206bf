"""Which decode steps may stream experts (`EngineConfig.stream_decode_rows`): the option's checks,
the "auto" rule from the cost model (never at 8 rows or fewer), the planner's `decode_rows` per
run and placement, and `DecodeTuner` weighing the decode path (k = 0) against streamed ks."""

from __future__ import annotations

import pytest

from hetmoe.config import EngineConfig
from hetmoe.engine.executor import prefill_planner
from hetmoe.engine.executor.prefill_planner import NEVER, DecodeClock, PrefillPlanner
from hetmoe.engine.placement.decode_split import (
    DECODE_GAIN,
    SMALL_DECODE,
    DecodeTuner,
    decode_stream_rows,
)
from hetmoe.engine.placement.expert_split import (
    CLIMB_ROUNDS,
    EXPLORE_PASSES,
    TRIES,
    SplitCosts,
    pass_seconds,
    plan_gpu_experts,
)
from hetmoe.engine.placement.placement_plan import plan_placement

COSTS = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6, gpu_token=0.07e-6,
                   gpu_fixed=70e-6, cpu_call=100e-6, split_fixed=100e-6, split_token=0.16e-6)
"""The Qwen3-30B-A3B int8 costs of tests/engine/test_expert_split.py (128 experts, top-8)."""


@pytest.mark.parametrize("bad", [-1, True, 2.5, "always", None])
def test_the_option_takes_auto_or_a_row_count(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^option stream_decode_rows must be 'auto' or an "
                       rf"integer >= 0 \(0: never\), got {bad!r}$"):
        EngineConfig(stream_decode_rows=bad)  # type: ignore[arg-type]
    for good in ("auto", 0, 1, 64):
        assert EngineConfig(stream_decode_rows=good).stream_decode_rows == good
    assert EngineConfig().stream_decode_rows == "auto"  # measured faster from 64 rows


def test_auto_starts_where_the_model_expects_the_split_to_pay() -> None:
    rows = decode_stream_rows(8, 128, COSTS, 1, 128, 256)
    assert rows is not None and rows > SMALL_DECODE

    def gain(n: int) -> float:
        k = plan_gpu_experts(n, 8, 128, COSTS, 1, 128)
        return pass_seconds(k, n, 8, 128, COSTS) / pass_seconds(0, n, 8, 128, COSTS)

    assert gain(rows) <= DECODE_GAIN < gain(rows - 1)  # the fewest rows that pay
    assert rows == 26  # these costs: a 16-row step's best split is 0.76 of the CPU's time
    assert decode_stream_rows(8, 128, COSTS, 1, 128, rows - 1) is None  # beyond the slots
    # Streaming every expert of a step never pays at these costs (the PCIe copy is the floor).
    assert decode_stream_rows(8, 128, COSTS, 128, 128, 256) is None


def test_small_steps_never_weigh_streaming_whatever_the_costs() -> None:
    cheap_gpu = SplitCosts(cpu_fixed=1e-3, cpu_token=1e-3, gpu_expert=1e-9)
    assert plan_gpu_experts(2, 8, 128, cheap_gpu) > 0  # the model would stream at 2 rows
    assert decode_stream_rows(8, 128, cheap_gpu, 1, 128, 256) == 16  # 16 x top-8 = 128 pairs
    assert decode_stream_rows(2, 8, cheap_gpu, 1, 8, 256) == SMALL_DECODE + 1


def _planner(resident: int = 0, refusal: str | None = "") -> PrefillPlanner:
    """A planner of 4 layers of 128 experts (top-8) with COSTS; `refusal` None: no GPU."""
    planner = PrefillPlanner(128, 8, 4, COSTS,
                             refusal=None if refusal is None else lambda: refusal)
    if resident:
        planner.place(plan_placement([128] * 4, [1] * 4, resident * 4))
    return planner


def test_the_planners_decode_rows_per_run_and_placement() -> None:
    planner = _planner()
    assert planner.decode_rows == NEVER  # until prepared
    planner.prepare("auto", 0, "auto", 256)
    assert planner.decode_rows == decode_stream_rows(8, 128, COSTS, 1, 128, 256) == 26
    planner.prepare("auto", 0, 100, 256)
    assert planner.decode_rows == 100  # a row count as given
    for mode, option in (("cpu", "auto"), ("cpu", 100), ("auto", 0), ("gpu", "auto")):
        planner.prepare(mode, 0, option, 256)  # "gpu" auto: streaming it all never pays
        assert planner.decode_rows == NEVER, (mode, option)
    planner.prepare("split", 0, "auto", 256)
    assert planner.decode_rows == decode_stream_rows(8, 128, COSTS, 1, 127, 256)
    no_gpu = _planner(refusal=None)
    no_gpu.prepare("auto", 0, 4, 256)
    assert no_gpu.decode_rows == NEVER
    placed = _planner(resident=16)
    placed.prepare("auto", 0, "auto", 256)  # the resident experts run on the GPU either way
    assert placed.decode_rows == decode_stream_rows(8, 128, COSTS, 1, 112, 256, (16,) * 4) == 30
    half = _planner(resident=64)
    half.prepare("auto", 0, "auto", 256)
    assert half.decode_rows == NEVER  # half the experts resident: no split gains 30 %
    placed.place(None)  # a new placement: unset until the runner prepares again
    assert placed.decode_rows == NEVER
    everything = _planner(resident=128)
    everything.prepare("auto", 0, 4, 256)
    assert everything.decode_rows == NEVER  # nothing to stream


def test_auto_loads_no_costs_where_no_step_exceeds_the_small_decode_rows() -> None:
    """The default "auto" on a runner of small batches (a chat's), or with a "gpu" prefill
    (which streams every miss and needs no costs itself): nothing weighs streaming, so no costs
    are measured at start."""
    asked = []

    def loader() -> SplitCosts:
        asked.append(1)
        return COSTS

    planner = PrefillPlanner(128, 8, 4, None, refusal=lambda: "", loader=loader)
    for rows in (SMALL_DECODE, 256):
        planner.prepare("gpu", 0, "auto", rows)
        assert planner.decode_rows == NEVER and not asked and planner.costs is None
    planner.prepare("gpu", 0, 64, 256)  # a row count asked: its k needs no costs either
    assert planner.decode_rows == 64 and not asked
    planner.prepare("split", 0, "auto", SMALL_DECODE + 1)  # the split's k comes from costs
    assert asked == [1] and planner.costs is COSTS


def test_decode_experts_per_mode() -> None:
    planner = _planner()
    assert planner.decode_experts(128, "cpu") == (0, False)
    assert planner.decode_experts(128, "gpu") == (128, False)
    split = plan_gpu_experts(128, 8, 128, COSTS, 1, 127)
    assert planner.decode_experts(128, "split") == (split, False)
    k, timed = planner.decode_experts(128, "auto")
    assert (k, timed) == (0, True)  # the tuner's first turn: the decode path, timed
    assert _planner(refusal="no room").decode_experts(128, "gpu") == (0, False)


def test_the_decode_tuner_weighs_the_decode_path_then_keeps_the_fastest() -> None:
    tuner = DecodeTuner()
    options = tuner.options(128, 8, 128, COSTS)
    best = plan_gpu_experts(128, 8, 128, COSTS, 1, 128)
    assert options[:2] == (0, best) and all(k > best for k in options[2:])
    turns = []
    for i in range(TRIES * len(options)):
        k, timed = tuner.pick(128, 8, 128, COSTS)
        assert timed
        turns.append(k)
        tuner.record(128, k, 1.0 if k == options[-1] else 2.0 + i)
    assert turns == list(options) * TRIES
    # The fastest, the highest split weighed: a climb round a coarse step above it, still timed.
    assert tuner.pick(128, 8, 128, COSTS) == (options[-1] + 8, True)
    tied = DecodeTuner()
    for k in tied.options(128, 8, 128, COSTS) * TRIES:
        tied.record(128, k, 1.0)
    assert tied.pick(128, 8, 128, COSTS) == (0, False)  # ties keep the decode path
    assert tuner.options(128, 8, 128, COSTS, (128,)) == (0,)  # every expert resident


def test_the_decode_tuner_weighs_finer_splits_around_its_best_k() -> None:
    tuner = DecodeTuner()
    coarse = (0, 54, 62, 70, 78)
    assert tuner.options(128, 8, 128, COSTS) == coarse
    # Least at 66, 10 ms more per k below it, 2 ms per k above; the decode path far slower.
    clock = {k: 0.2 + (0.01 * (66 - k) if k < 66 else 0.002 * (k - 66)) for k in range(1, 129)}
    clock[0] = 1.0
    turns = []
    while (pick := tuner.pick(128, 8, 128, COSTS))[1]:
        turns.append(pick[0])
        tuner.record(128, pick[0], clock[pick[0]] * 128)
    # 70 (coarse), then 66/74 (66), 64/68 (66 holds), 65/67 (66 holds).
    assert turns == [*coarse, *coarse, 66, 74, 66, 74, 64, 68, 64, 68, 65, 67, 65, 67]
    assert len(turns) == EXPLORE_PASSES - TRIES * CLIMB_ROUNDS  # 78, the top, is not fastest
    assert pick == (66, False)  # settled: no more timing
    assert tuner.pick(255, 8, 128, COSTS) == (66, False)  # the same bucket
    # The decode path fastest: no finer round, settled after the coarse one.
    path = DecodeTuner()
    for k in coarse * TRIES:
        assert path.pick(128, 8, 128, COSTS) == (k, True)
        path.record(128, k, 0.1 if k == 0 else 1.0)
    assert path.pick(128, 8, 128, COSTS) == (0, False) and path.weighed[8] == coarse


def test_the_decode_clock_times_each_step_to_the_next_ones_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(prefill_planner.time, "perf_counter", lambda: now[0])
    clock, tuner, slots, lengths = DecodeClock(), DecodeTuner(), (3, 5), [0] * 8

    def step(k: int, inside: float, gap: float) -> None:
        """A timed step of k taking `inside` seconds, then `gap` seconds of host work."""
        start = clock.start(slots, lengths, tuner)
        now[0] += inside
        for s in slots:
            lengths[s] += 1
        clock.timed(slots, k, start, lengths)
        now[0] += gap

    step(0, 0.010, 0.004)
    step(7, 0.020, 0.004)  # the host's gap counts for every k: 14 ms, then 24 ms
    clock.start(slots, lengths, tuner)
    bucket = tuner.measured[tuner.bucket(2)]
    assert bucket[0] == [pytest.approx(0.014 / 2)] and bucket[7] == [pytest.approx(0.024 / 2)]
    step(7, 0.020, 0.0)
    lengths[3] += 1  # another step wrote to a row: not recorded
    clock.start(slots, lengths, tuner)
    step(7, 0.020, 0.0)
    clock.start((3,), lengths, tuner)  # other rows: not recorded
    step(7, 0.020, 0.0)
    clock.interrupt()  # a prefill pass between: not recorded
    clock.start(slots, lengths, tuner)
    assert bucket[7] == [pytest.approx(0.012)]
