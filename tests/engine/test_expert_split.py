"""Where a GPU prefill layer's experts run (engine/placement/expert_split.py) and the GPU side's
compute of a subset of experts (`routed_mlp(local=...)`), on the CPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.placement.expert_split import (
    CLIMB_ROUNDS,
    EXPLORE_PASSES,
    EXPLORE_WITHIN,
    TRIES,
    PrefillTuner,
    SplitCosts,
    costs_from_profile,
    finer_steps,
    layer_seconds,
    most_misses,
    pass_seconds,
    plan_gpu_experts,
)
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.routed_mlp import routed_mlp

# Per expert of the Qwen3-30B-A3B shape in int8 on an H100 host (docs/benchmarks/prefill.md):
# CPU reads 4.9 MB at ~100 GB/s and does 9.4 MFLOP per pair at ~4.6 TFLOPS; PCIe ~54 GB/s.
COSTS = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6, gpu_token=0.07e-6,
                   gpu_fixed=70e-6, cpu_call=100e-6, split_fixed=100e-6, split_token=0.16e-6)


def brute_force(tokens: int, top_k: int, experts: int, costs: SplitCosts) -> float:
    """Seconds of a layer at the best k, straight from the cost formulas of the docstring."""
    pairs = tokens * top_k
    n, active = pairs / experts, 1 - (1 - 1 / experts) ** pairs
    best = float("inf")
    for k in range(experts + 1):
        copy, gpu = k * costs.gpu_expert, k * (costs.gpu_fixed + n * costs.gpu_token)
        cpu = costs.cpu_call + (experts - k) * (active * costs.cpu_fixed + n * costs.cpu_token)
        if k == experts:
            seconds = max(copy, gpu)
        elif k == 0:
            seconds = cpu
        else:
            seconds = max(copy, costs.split_fixed + tokens * costs.split_token + max(cpu, gpu))
        best = min(best, seconds)
    return best


@pytest.mark.parametrize("tokens", [1, 7, 64, 128, 512, 1024, 4096, 16384])
def test_plan_takes_the_fastest_k(tokens: int) -> None:
    k = plan_gpu_experts(tokens, 8, 128, COSTS)
    assert 0 <= k <= 128
    assert layer_seconds(k, tokens, 8, 128, COSTS) == pytest.approx(
        brute_force(tokens, 8, 128, COSTS))


def test_short_prompts_stay_on_the_cpu_long_ones_stream_between_them_split() -> None:
    plan = {t: plan_gpu_experts(t, 8, 128, COSTS) for t in (1, 4, 512, 1024, 16384)}
    assert plan[1] == 0  # 8 experts' weights: the CPU reads them before one could be copied
    assert plan[4] < 32  # ~28 experts read: a few copied ahead take a little off the CPU
    assert 0 < plan[512] < 128 and 0 < plan[1024] < 128  # both sides, about equal times
    assert plan[512] > plan[1024] / 2  # more tokens: more of the work on the GPU
    # GPU-bound: a split's round trip costs more than the CPU's share could take off the GPU.
    assert plan[16384] == 128
    k = plan[512]  # PCIe-bound: the CPU takes experts until its side lasts as long as the copies
    cpu = COSTS.cpu_call + COSTS.split_fixed + 512 * COSTS.split_token + (128 - k) * (
        COSTS.cpu_fixed + 32 * COSTS.cpu_token)
    assert abs(cpu - k * COSTS.gpu_expert) <= COSTS.cpu_fixed + 32 * COSTS.cpu_token + 92e-6


def test_split_only_mode_and_bounds() -> None:
    for tokens in (1, 16384):
        k = plan_gpu_experts(tokens, 8, 128, COSTS, least=1, most=127)
        assert 1 <= k <= 127
        assert layer_seconds(k, tokens, 8, 128, COSTS) == min(
            layer_seconds(j, tokens, 8, 128, COSTS) for j in range(1, 128))
    with pytest.raises(ValueError, match="least <= most"):
        plan_gpu_experts(8, 8, 128, COSTS, least=5, most=4)
    with pytest.raises(ValueError, match=r"k must be in \[0, 128\]"):
        layer_seconds(129, 8, 8, 128, COSTS)


def test_gpu_compute_bounds_the_gpu_side_when_slower_than_its_copies() -> None:
    slow_gpu = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6,
                          gpu_token=2.0e-6, gpu_fixed=10e-6)
    assert plan_gpu_experts(16384, 8, 128, slow_gpu) < 128  # the CPU takes a share again
    assert layer_seconds(128, 16384, 8, 128, slow_gpu) == pytest.approx(
        128 * (10e-6 + 1024 * 2.0e-6))


@dataclass
class Profile:
    cpu_read_bytes_s: float = 100e9
    cpu_call_s: float = 50e-6
    cpu_flops: dict[str, float] = field(default_factory=lambda: {"int8": 4e12})
    cpu_expert_bytes_s: dict[str, float] = field(default_factory=lambda: {"int8": 80e9})
    h2d_bytes_s: float | None = 50e9
    d2h_bytes_s: float | None = 40e9
    gpu_host_read_bytes_s: float | None = 10e9
    gpu_flops: dict[str, float] | None = field(default_factory=lambda: {"int8": 200e12})
    gpu_expert_bytes_s: dict[str, float] | None = field(default_factory=lambda: {"int8": 70e9})


def test_costs_from_a_profile_follow_the_layer_shape() -> None:
    moe = CpuMoE(8, 64, 96, "int8")
    expert_bytes = sum(p.expert_bytes for p in moe.packed_groups())
    costs = costs_from_profile(Profile(), moe)  # type: ignore[arg-type]
    assert costs.cpu_fixed == pytest.approx(expert_bytes / 80e9)
    assert costs.gpu_fixed == pytest.approx(expert_bytes / 70e9)
    assert costs.gpu_expert == pytest.approx(expert_bytes / 50e9)
    assert costs.cpu_token == pytest.approx(6 * 64 * 96 / 4e12)
    assert costs.gpu_token == pytest.approx(6 * 64 * 96 / 200e12)
    assert costs.cpu_call == 50e-6 and costs.split_fixed == 50e-6
    assert costs.split_token == pytest.approx(2 * 64 / 40e9 + 2 * 64 / 10e9)
    with pytest.raises(ValueError, match="no host-to-GPU copy rate"):
        costs_from_profile(Profile(h2d_bytes_s=None), moe)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no CPU rate for int8 experts"):
        costs_from_profile(Profile(cpu_flops={"bf16": 1e12}), moe)  # type: ignore[arg-type]


@pytest.mark.parametrize("hidden", [64, 40])
def test_routed_mlp_on_a_subset_of_experts_adds_up_to_all(hidden: int) -> None:
    g = torch.Generator().manual_seed(3)
    e, s, t, k = 6, 32, 13, 3
    hp = 64
    gate_up = (torch.randn(e, 2 * s, hp, generator=g) * 0.2).to(torch.bfloat16)
    gate_up[:, :, hidden:] = 0
    down = (torch.randn(e, 64, s, generator=g) * 0.2).to(torch.bfloat16)
    down[:, hidden:] = 0
    x = torch.randn(t, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    full = routed_mlp(x, ids, w, [(gate_up, down)], grouped=False)
    here = torch.tensor([0, 2, 5])
    rest = torch.tensor([1, 3, 4])
    parts = []
    for chosen in (here, rest):
        local = torch.full((e,), -1, dtype=torch.int64)
        local[chosen] = torch.arange(len(chosen))
        parts.append(routed_mlp(x, ids, w, [(gate_up[chosen], down[chosen])], grouped=False,
                                local=local))
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)
    nowhere = torch.full((e,), -1, dtype=torch.int64)
    assert routed_mlp(x, ids, w, [(gate_up[:1], down[:1])], False, nowhere).abs().max() == 0


def test_prefill_options_are_checked() -> None:
    assert EngineConfig(prefill_experts="split").prefill_experts == "split"
    with pytest.raises(ValueError, match="prefill_experts must be one of auto, cpu, gpu, split"):
        EngineConfig(prefill_experts="yes")
    with pytest.raises(ValueError, match="prefill_resident_bytes must be an integer >= 0"):
        EngineConfig(prefill_resident_bytes=-1)


def test_tuner_alternates_the_model_its_rival_and_the_splits_above_then_keeps_the_fastest(
        ) -> None:
    tuner = PrefillTuner()
    model = plan_gpu_experts(4096, 8, 128, COSTS)
    assert model == 111  # the model splits at 4K with these costs
    options = (model, 128, model + 8, model + 16)  # the stream, then splits 8 and 16 above
    assert tuner.options(4096, 8, 128, COSTS) == options
    first = {model: 0.9, 128: 2.0, 119: 1.0, 127: 1.1}  # the stream's first pass warms up
    seen = []
    for seconds in (first, {model: 0.8, 128: 0.6, 119: 0.7, 127: 0.9}):
        for _ in options:
            k = tuner.choose(4096, 8, 128, COSTS)
            seen.append(k)
            tuner.record(4096, k, seconds[k])
    assert seen == [*options, *options]  # turns, two passes each
    assert tuner.choose(4096, 8, 128, COSTS) == 128  # its best pass (0.6) beat every split's
    assert tuner.choose(6000, 8, 128, COSTS) == 128  # same bucket (4096-8191), per token
    tuner.record(4096, 119, 0.5)  # a neighbour's latest pass is faster still
    assert tuner.choose(4096, 8, 128, COSTS) == 119
    assert tuner.choose(2048, 8, 128, COSTS) == plan_gpu_experts(2048, 8, 128, COSTS)


# Measured on an H100 box (16-core AMX Xeon), Qwen3-30B-A3B shape, INT4, 24 layers, 512 tokens:
# the costs per expert and the seconds per pass streaming exactly k experts per layer.
INT4_COSTS = SplitCosts(cpu_fixed=6.724e-05, cpu_token=2.472e-06, gpu_expert=5.872e-05,
                        gpu_token=5.914e-08, gpu_fixed=5.589e-05, cpu_call=1.159e-05,
                        split_fixed=1.159e-05, split_token=1.556e-07)
INT4_PASS_S = {96: 0.2254, 104: 0.1892, 108: 0.1581, 112: 0.1640, 120: 0.1741, 128: 0.2064}


def int4_pass_seconds(k: int) -> float:
    """The measured pass at k, linear between the measured ks (the nearest one outside them)."""
    ks = sorted(INT4_PASS_S)
    if k <= ks[0] or k >= ks[-1]:
        return INT4_PASS_S[ks[0] if k <= ks[0] else ks[-1]]
    hi = next(j for j in ks if j >= k)
    lo = max(j for j in ks if j <= k)
    if hi == lo:
        return INT4_PASS_S[k]
    return INT4_PASS_S[lo] + (k - lo) / (hi - lo) * (INT4_PASS_S[hi] - INT4_PASS_S[lo])


def test_tuner_finds_the_int4_split_the_model_underestimates() -> None:
    # The model splits at 92 (it leaves out the serial GPU work a split layer waits for); the
    # measured best is 108, 1.31x the stream. Timing the model's k against the stream alone
    # kept the stream; the splits above the model's k find 108, and the finer rounds around it
    # (linear between the measured ks) keep it.
    assert plan_gpu_experts(512, 8, 128, INT4_COSTS) == 92
    tuner = PrefillTuner()
    assert tuner.options(512, 8, 128, INT4_COSTS) == (92, 128, 100, 108, 116)
    for _ in range(TRIES * 11):  # 116, the highest split, is not the fastest: no climb
        k = tuner.choose(512, 8, 128, INT4_COSTS)
        tuner.record(512, k, int4_pass_seconds(k))
    assert tuner.settled(10) and tuner.choose(512, 8, 128, INT4_COSTS) == 108
    assert tuner.weighed[10] == (92, 128, 100, 108, 116, 104, 112, 106, 110, 107, 109)
    assert sorted(len(t) for t in tuner.measured[10].values()) == [TRIES] * 11


def steep_below(best: int, stream: float = 0.2064) -> dict[int, float]:
    """A pass's seconds per k: least at `best`, 4 ms more per k below it, 1.5 ms per k above,
    the stream `stream` (the INT4 box's shape, its best between the coarse points)."""
    clock = {k: 0.15 + (0.004 * (best - k) if k < best else 0.0015 * (k - best))
             for k in range(128)}
    return clock | {128: stream}


def weigh(tuner: PrefillTuner, tokens: int, clock: dict[int, float],
          costs: SplitCosts = INT4_COSTS) -> list[int]:
    """The k of each pass a bucket weighs until settled, each taking `clock[k]` seconds."""
    turns: list[int] = []
    while not turns or not tuner.settled(tuner.bucket(tokens)):
        k, timed = tuner.pick(tokens, 8, 128, costs)
        assert timed, turns
        if tuner.settled(tuner.bucket(tokens)):
            break
        turns.append(k)
        tuner.record(tokens, k, clock[k] * tokens)
    return turns


def test_finer_rounds_find_a_best_split_between_the_coarse_points() -> None:
    tuner = PrefillTuner()
    coarse = (92, 128, 100, 108, 116)
    turns = weigh(tuner, 512, steep_below(106))
    # 108 (coarse), then 104/112 (108 holds), 106/110 (106), 105/107 (106 holds).
    assert turns == [*coarse, *coarse, 104, 112, 104, 112, 106, 110, 106, 110, 105, 107, 105, 107]
    assert len(turns) == EXPLORE_PASSES - TRIES * CLIMB_ROUNDS  # 116, the top, is not fastest
    assert tuner.pick(512, 8, 128, INT4_COSTS) == (106, True)
    assert tuner.choose(1000, 8, 128, INT4_COSTS) == 106  # the same bucket (512-1023)


def test_climb_rounds_follow_a_fastest_highest_split() -> None:
    # The best at 124, above the coarse round's highest split (116): one climb to 124, none to
    # 132 (past the 127 splits), then the finer rounds around 124 (128 clamped to 127).
    tuner = PrefillTuner()
    coarse = (92, 128, 100, 108, 116)
    turns = weigh(tuner, 512, steep_below(124))
    assert turns == [*coarse, *coarse, 124, 124, 120, 127, 120, 127, 122, 126, 122, 126, 123,
                     125, 123, 125]
    assert tuner.choose(512, 8, 128, INT4_COSTS) == 124 and tuner.climbs[10] == CLIMB_ROUNDS - 1


def test_climbs_stop_after_their_rounds_and_below_the_stream() -> None:
    # CPU costs 0.4x: the model splits at 65; the splits get faster up to 127 (the stream slow).
    # Four climbs (97 .. 121), then finer rounds, bounded from the climbed best, reach 127.
    low = dataclasses.replace(INT4_COSTS, cpu_fixed=0.4 * INT4_COSTS.cpu_fixed,
                              cpu_token=0.4 * INT4_COSTS.cpu_token)
    tuner = PrefillTuner()
    assert tuner.options(512, 8, 128, low) == (65, 73, 81, 89)  # the stream is far: not weighed
    turns = weigh(tuner, 512, {k: 1 - k / 1000 for k in range(128)} | {128: 2.0}, low)
    assert tuner.weighed[10][4:8] == (97, 105, 113, 121) and tuner.climbs[10] == 0
    assert tuner.choose(512, 8, 128, low) == 127 and 128 not in turns
    assert len(turns) <= EXPLORE_PASSES


def test_a_settled_round_leaves_the_bucket_unsettled_while_a_finer_one_follows() -> None:
    tuner, clock = PrefillTuner(), steep_below(106)
    for _ in range(2 * 5):  # the coarse round's passes
        k = tuner.choose(512, 8, 128, INT4_COSTS)
        tuner.record(512, k, clock[k] * 512)
    assert tuner.round_settled(10) and not tuner.settled(10)  # the finer rounds are still to come
    assert tuner.pick(512, 8, 128, INT4_COSTS) == (104, True)
    assert tuner.weighed[10][5:] == (104, 112) and tuner.finer[10] == (2, 1)


def test_finer_rounds_stay_inside_the_misses_and_the_models_bound() -> None:
    # 4096 tokens, int8: the splits faster the more they stream (the stream slower): the finer
    # rounds climb to 127, never to a k of 128 or more (k + 4 = 131 is clamped to 127, weighed).
    tuner = PrefillTuner()
    assert tuner.options(4096, 8, 128, COSTS) == (111, 128, 119, 127)
    clock = {k: 1.0 - k / 1000 for k in range(128)} | {128: 2.0}
    turns = weigh(tuner, 4096, clock, COSTS)
    assert turns[8:] == [123, 123, 125, 125, 126, 126]
    assert tuner.choose(4096, 8, 128, COSTS) == 127
    # 16384 tokens: the model streams, its best split 120 the rival. Splits faster the fewer
    # they stream: the rounds reach down to 117, not to 116, which the model predicts beyond
    # `EXPLORE_WITHIN` of the stream.
    model = pass_seconds(128, 16384, 8, 128, COSTS)
    assert pass_seconds(116, 16384, 8, 128, COSTS) > EXPLORE_WITHIN * model
    assert pass_seconds(117, 16384, 8, 128, COSTS) <= EXPLORE_WITHIN * model
    tuner = PrefillTuner()
    clock = {k: k / 1000 for k in range(128)} | {128: 2.0}
    turns = weigh(tuner, 16384, clock, COSTS)
    assert turns == [128, 120, 128, 120, 124, 124, 118, 122, 118, 122, 117, 119, 117, 119]
    assert tuner.choose(16384, 8, 128, COSTS) == 117
    assert all(pass_seconds(k, 16384, 8, 128, COSTS) <= EXPLORE_WITHIN * model
               for k in tuner.weighed[15])


def test_no_finer_round_when_the_stream_or_the_cpu_is_fastest() -> None:
    tuner = PrefillTuner()
    turns = weigh(tuner, 512, steep_below(106, stream=0.1))  # the stream beats every split
    assert turns == [92, 128, 100, 108, 116] * TRIES
    assert tuner.choose(512, 8, 128, INT4_COSTS) == 128
    assert tuner.weighed[10] == (92, 128, 100, 108, 116)
    fast_cpu = dataclasses.replace(COSTS, cpu_fixed=5e-6, cpu_token=0.05e-6)
    tuner = PrefillTuner()
    assert tuner.options(4096, 8, 128, fast_cpu) == (0, 22, 30)  # the model keeps the CPU
    turns = weigh(tuner, 4096, {0: 1.0, 22: 1.2, 30: 1.1}, fast_cpu)
    assert turns == [0, 22, 30] * TRIES and tuner.choose(4096, 8, 128, fast_cpu) == 0
    assert tuner.weighed[13] == (0, 22, 30)


def test_no_finer_round_below_a_coarse_step_of_two() -> None:
    # A staging of 20 experts per layer: a coarse step of 1, nothing finer to weigh.
    assert finer_steps(20) == () and finer_steps(32) == (1,) and finer_steps(128) == (4, 2, 1)
    assert finer_steps(100) == (3, 1) and finer_steps(256) == (8, 4, 2)  # at most 3 rounds


def test_tuner_neighbours_respect_the_staging_cap() -> None:
    # A staging of 100 experts per layer: the stream is k = 100; a split 6 above the model's.
    assert PrefillTuner().options(512, 8, 128, INT4_COSTS, cap=100) == (92, 100, 98)
    assert PrefillTuner().options(512, 8, 128, INT4_COSTS, cap=4) == (4, 3)
    tuner = PrefillTuner()
    for _ in range(EXPLORE_PASSES):
        k = tuner.choose(512, 8, 128, INT4_COSTS, cap=100)
        assert k <= 100
        tuner.record(512, k, int4_pass_seconds(k))
    assert tuner.choose(512, 8, 128, INT4_COSTS, cap=100) == 100  # 100 measured best of them


def test_tuner_weighs_the_splits_above_a_split_whose_rival_is_far() -> None:
    # INT8 on an H100 box (round 5): at 512 tokens the stream is predicted 1.5x+ slower than the
    # model's split (it beat the stream 1.66x): the stream is not weighed, the splits above are.
    int8 = SplitCosts(cpu_fixed=2.962e-05, cpu_token=1.186e-06, gpu_expert=9.037e-05,
                      gpu_token=6.235e-08, gpu_fixed=7.549e-05, cpu_call=9.591e-06,
                      split_fixed=9.591e-06, split_token=1.549e-07)
    tuner = PrefillTuner()
    assert tuner.options(512, 8, 128, int8) == (55, 63, 71, 79)
    assert tuner.pick(512, 8, 128, int8) == (55, True)
    # INT4 with CPU costs as one H200 box measured them (0.6x the costs above): the model's 77
    # alone was kept untimed, while other boxes measured the best near 100-110. Now the splits
    # above are weighed and the climb rounds follow a clock that falls to 110.
    fast = dataclasses.replace(INT4_COSTS, cpu_fixed=0.6 * INT4_COSTS.cpu_fixed,
                               cpu_token=0.6 * INT4_COSTS.cpu_token)
    assert PrefillTuner().options(512, 8, 128, fast) == (77, 85, 93, 101)
    tuner = PrefillTuner()
    weigh(tuner, 512, steep_below(110), fast)
    assert tuner.choose(512, 8, 128, fast) == 110
    assert 128 not in tuner.weighed[10]


def test_tuner_never_tries_a_rival_the_model_finds_far_slower() -> None:
    tuner = PrefillTuner()
    for tokens in (1, 15):  # fewer pairs than experts: the model's pick, no rival
        model = plan_gpu_experts(tokens, 8, 128, COSTS)
        for k in (model, 0, 128):
            tuner.record(tokens, k, 0.01 if k != model else 0.02)
        assert tuner.choose(tokens, 8, 128, COSTS) == model
    model = plan_gpu_experts(32, 8, 128, COSTS)
    assert 0 < model < 128  # 32 tokens: a split; the stream would copy every expert
    for _ in range(EXPLORE_PASSES):  # the model's split and splits near it, never the stream
        k = tuner.choose(32, 8, 128, COSTS)
        assert 0 < k < 128
        tuner.record(32, k, 0.03)
    assert plan_gpu_experts(16384, 8, 128, COSTS) == 128
    rival = plan_gpu_experts(16384, 8, 128, COSTS, 1, 127)  # its best split
    for _ in range(4):
        k = tuner.choose(16384, 8, 128, COSTS)
        assert k in (128, rival)
        tuner.record(16384, k, 1.3 if k == 128 else 2.0)
    assert tuner.choose(16384, 8, 128, COSTS) == 128


def test_resident_experts_cost_their_gpu_compute_and_no_copy() -> None:
    tokens, n = 4096, 4096 * 8 / 128  # pairs per expert
    gpu_one = COSTS.gpu_fixed + n * COSTS.gpu_token
    assert layer_seconds(0, tokens, 8, 128, COSTS, resident=128) == pytest.approx(128 * gpu_one)
    # 96 resident, 32 misses streamed: the copies of the 32 against the GPU's 128 computes.
    assert layer_seconds(32, tokens, 8, 128, COSTS, resident=96) == pytest.approx(
        max(32 * COSTS.gpu_expert, 128 * gpu_one))
    # 96 resident, the 32 misses on the CPU: a split's round trip, then the later side.
    cpu = COSTS.cpu_call + 32 * (COSTS.cpu_fixed + n * COSTS.cpu_token)
    assert layer_seconds(0, tokens, 8, 128, COSTS, resident=96) == pytest.approx(
        COSTS.split_fixed + tokens * COSTS.split_token + max(cpu, 96 * gpu_one))
    with pytest.raises(ValueError, match=r"k must be in \[0, 32\], got 33"):
        layer_seconds(33, tokens, 8, 128, COSTS, resident=96)
    with pytest.raises(ValueError, match=r"resident experts must be in \[0, 128\], got 129"):
        layer_seconds(0, tokens, 8, 128, COSTS, resident=129)


def test_a_pass_streams_at_most_each_layers_misses() -> None:
    resident = [96, 100, 96]  # misses 32, 28, 32
    assert most_misses(128, resident) == 32 and most_misses(128) == 128
    for k in (0, 20, 30, 32):
        want = sum(layer_seconds(min(k, 128 - r), 4096, 8, 128, COSTS, r) for r in resident)
        assert pass_seconds(k, 4096, 8, 128, COSTS, resident) == pytest.approx(want)
    k = plan_gpu_experts(4096, 8, 128, COSTS, resident=resident)
    assert pass_seconds(k, 4096, 8, 128, COSTS, resident) == min(
        pass_seconds(j, 4096, 8, 128, COSTS, resident) for j in range(33))
    with pytest.raises(ValueError, match=r"need 0 <= least <= most <= 32, got 1, 33"):
        plan_gpu_experts(4096, 8, 128, COSTS, 1, 33, resident)


def test_the_misses_go_to_the_faster_side_and_the_placement_saves_time() -> None:
    resident = [96] * 48  # 75 % of each layer on the GPU
    fast_cpu = dataclasses.replace(COSTS, cpu_fixed=5e-6, cpu_token=0.05e-6)
    slow_cpu = dataclasses.replace(COSTS, cpu_fixed=500e-6, cpu_token=20e-6)
    assert plan_gpu_experts(4096, 8, 128, fast_cpu, resident=resident) == 0  # misses: CPU
    assert plan_gpu_experts(4096, 8, 128, slow_cpu, resident=resident) == 32  # all streamed
    # The packed kernels read a resident expert from GPU memory (4.9 MB at ~2 TB/s), far
    # sooner than its copy: the placement saves time at every length, most where the copies
    # bound the pass (16K: the GPU's products do).
    kernels = dataclasses.replace(COSTS, gpu_fixed=2.5e-6)
    for tokens, gain in ((512, 3.0), (4096, 3.0), (16384, 1.2)):
        placed = plan_gpu_experts(tokens, 8, 128, kernels, resident=resident)
        none = plan_gpu_experts(tokens, 8, 128, kernels)
        assert (gain * pass_seconds(placed, tokens, 8, 128, kernels, resident)
                < 48 * layer_seconds(none, tokens, 8, 128, kernels)), tokens


def test_tuner_counts_the_misses_of_a_placement() -> None:
    tuner = PrefillTuner()
    resident = [96] * 4
    model = tuner.choose(16384, 8, 128, COSTS, resident)
    assert model == plan_gpu_experts(16384, 8, 128, COSTS, resident=resident)
    one_miss = [127] * 4  # no split exists: the stream and the CPU take turns
    tuner = PrefillTuner()  # a tuner's timings are of one placement
    seen = []
    for seconds in (1.0, 2.0, 1.0, 2.0):
        k = tuner.choose(16384, 8, 128, COSTS, one_miss)
        seen.append(k)
        tuner.record(16384, k, seconds if k == 1 else 3.0)
    assert sorted(set(seen)) == [0, 1]
    assert tuner.choose(16384, 8, 128, COSTS, one_miss) == 1
    assert PrefillTuner().choose(16384, 8, 128, COSTS, [128] * 4) == 0  # nothing to stream
