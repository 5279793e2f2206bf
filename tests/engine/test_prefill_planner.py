"""`PrefillPlanner` (engine/executor/prefill_planner.py): its k per mode is the cost model's and the
tuner's for the same inputs, the placement counted; only passes the tuner weighs are timed (a GPU
sync each); its costs are loaded when the runner starts, never inside a request, and not at all
with every expert resident; a GPU it cannot stream to keeps prefill on the CPU."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor import prefill_planner
from hetmoe.engine.executor.prefill_planner import PrefillPlanner, check_prefill_mode, needs_costs
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import (
    PrefillTuner,
    SplitCosts,
    describe_plan,
    plan_gpu_experts,
)
from hetmoe.engine.placement.placement_plan import plan_placement
from hetmoe.engine.placement.slots import expert_bytes

COSTS = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6, gpu_token=0.07e-6,
                   gpu_fixed=70e-6, cpu_call=100e-6, split_fixed=100e-6, split_token=0.16e-6)
"""The Qwen3-30B-A3B int8 costs of tests/engine/test_expert_split.py."""

EAGER = SplitCosts(cpu_fixed=1e-3, cpu_token=1e-3, gpu_expert=1e-6)


def _planner(resident: int = 0, layers: int = 4) -> PrefillPlanner:
    """A planner of `layers` layers of 128 experts (top-8) that can stream, `resident` experts
    of each layer placed on the GPU."""
    planner = PrefillPlanner(128, 8, layers, COSTS, refusal=lambda: "")
    if resident:
        planner.place(plan_placement([128] * layers, [1] * layers, resident * layers))
    return planner


@pytest.mark.parametrize("resident", [0, 5, 96])
@pytest.mark.parametrize("tokens", [1, 64, 512, 4096, 16384])
def test_each_mode_is_the_cost_model_and_tuner_for_the_same_inputs(resident: int,
                                                                    tokens: int) -> None:
    planner = _planner(resident)
    counts = [resident] * 4
    most = 128 - resident
    assert planner.resident == tuple(counts) and planner.most == most
    assert planner.gpu_experts(tokens, "cpu") == 0
    assert planner.gpu_experts(tokens, "gpu") == most
    assert planner.gpu_experts(tokens, "split") == plan_gpu_experts(
        tokens, 8, 128, COSTS, 1, most - 1, counts)
    assert planner.gpu_experts(tokens, "auto") == PrefillTuner().choose(
        tokens, 8, 128, COSTS, counts)


def test_auto_follows_what_the_passes_measured() -> None:
    planner, tokens = _planner(), 16384
    model = plan_gpu_experts(tokens, 8, 128, COSTS)
    rival = plan_gpu_experts(tokens, 8, 128, COSTS, 1, 127)
    assert model == 128 and 0 < rival < 128  # the stream, with a split as its rival
    for k, seconds in ((model, 2.0), (rival, 1.0)) * 2:
        planner.tuner.record(tokens, k, seconds)
    finer = []  # measured faster: finer rounds around it, each k slower (116: the model's far)
    while not planner.tuner.settled(15) or not finer:
        finer.append(k := planner.gpu_experts(tokens))
        planner.tuner.record(tokens, k, 1.5)
    assert finer == [124, 124, 118, 122, 118, 122, 119, 121, 119, 121]
    assert planner.gpu_experts(tokens) == rival  # the fastest of them all: kept
    planner.place(None)  # a new placement: its timings were of the old one
    assert planner.tuner.measured == {} and planner.gpu_experts(tokens) == model


def test_nothing_streams_without_a_gpu_room_or_misses(caplog: pytest.LogCaptureFixture) -> None:
    no_gpu = PrefillPlanner(128, 8, 4, COSTS)  # no refusal check: nothing to stream to
    assert [no_gpu.gpu_experts(4096, m) for m in ("auto", "gpu", "split")] == [0, 0, 0]
    checks: list[int] = []

    def refusal() -> str:
        checks.append(1)
        return "needs 9 GB of free GPU memory"

    full = PrefillPlanner(128, 8, 4, COSTS, refusal=refusal)
    with caplog.at_level(logging.WARNING, logger="hetmoe.engine.executor.prefill_planner"):
        assert full.gpu_experts(4096, "gpu") == full.gpu_experts(4096, "auto") == 0
    assert len(checks) == 1  # checked once per placement, logged once
    assert caplog.messages == ["needs 9 GB of free GPU memory: long prompts prefill on the CPU"]
    everything = _planner(128)
    assert everything.everything and everything.gpu_experts(16384, "gpu") == 0
    assert everything.describe(0) == "GPU (every expert resident)"


class _Overlap:
    """What `prefill_pass` uses of a GPU's `MoEOverlap`: the ks of its streamed passes."""

    host, device = True, torch.device("cpu")

    def __init__(self) -> None:
        self.streamed_ks: list[int] = []
        self.pending: list[object] = []  # no CPU share started in stream order

    def make_streamer(self) -> None:
        pass

    @contextmanager
    def streamed(self, tokens: int, k: int) -> Iterator[None]:
        self.streamed_ks.append(k)
        yield


def _passes(planner: PrefillPlanner, lengths: list[int], mode: str = "auto") -> list[int]:
    """The k of a prefill pass of each length (a fake GPU overlap carries them out)."""
    planner.overlap = _Overlap()  # type: ignore[assignment]
    ks = []
    for tokens in lengths:
        ks.append(planner.gpu_experts(tokens, mode))
        with planner.prefill_pass(tokens, mode):
            pass
    return ks


def test_only_passes_the_tuner_weighs_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    planner = _planner()
    # 1 and 15 tokens: fewer pairs than experts; 4096: the model's pick, a close rival and the
    # splits above take turns (TRIES each).
    few = _passes(planner, [1, 15, 1])
    assert few == [PrefillTuner().choose(t, 8, 128, COSTS) for t in (1, 15, 1)]
    assert syncs == [] and planner.tuner.measured == {}  # decided by the model: no sync
    model, rival = plan_gpu_experts(4096, 8, 128, COSTS), 128
    assert 0 < model < rival
    options = [model, rival, model + 8, model + 16]
    assert _passes(planner, [4096] * 8) == options * 2  # exploration
    assert syncs == [torch.device("cpu")] * 8
    assert {k: len(t) for k, t in planner.tuner.measured[13].items()} == dict.fromkeys(options, 2)
    assert list(planner.tuner.measured) == [13]  # only the weighed bucket (4096-8191)
    for mode in ("cpu", "gpu", "split"):  # no tuner in these modes
        _passes(planner, [4096, 16384], mode)
    assert len(syncs) == 8
    everything = _planner(128)  # every expert resident: nothing to weigh
    assert _passes(everything, [4096, 16384]) == [0, 0] and len(syncs) == 8
    no_room = PrefillPlanner(128, 8, 4, COSTS, refusal=lambda: "no room")
    assert _passes(no_room, [16384]) == [0] and len(syncs) == 8


def test_describe_counts_the_resident_experts() -> None:
    plain = _planner()
    for k in (0, 17, 128):
        assert plain.describe(k) == describe_plan(k, 128)
    placed = _planner(8)
    on_gpu = "8 resident experts per layer on the GPU"
    assert placed.describe(0) == f"CPU ({on_gpu})"
    assert placed.describe(120) == f"GPU stream ({on_gpu})"
    assert placed.describe(30) == (f"split (30 of 120 misses per layer streamed to the GPU; "
                                   f"{on_gpu})")


def test_bad_inputs_are_named() -> None:
    planner = PrefillPlanner(128, 8, 4, refusal=lambda: "")
    with pytest.raises(RuntimeError, match=r"prefill_experts='auto' plans with this machine's "
                       r"costs, which were not loaded when the runner started"):
        planner.gpu_experts(4096, "auto")
    with pytest.raises(ValueError, match="PrefillPlanner: no costs and no loader for them"):
        planner.load_costs()
    with pytest.raises(ValueError, match="a placement of 2 MoE layers for a model of 4"):
        planner.place(plan_placement([128] * 2, [1] * 2, 4))
    with pytest.raises(ValueError, match="plans on paper only"):
        with planner.prefill_pass(8):
            pass
    with pytest.raises(ValueError, match=r"^option prefill_experts='split' computes experts on a "
                       r"GPU; this run is on cpu \(use 'auto' or 'cpu'\)$"):
        check_prefill_mode("split", torch.device("cpu"))
    check_prefill_mode("auto", torch.device("cpu"))


def test_costs_are_needed_by_a_gpu_auto_or_split_prefill_or_fetches() -> None:
    assert needs_costs(True, "auto", 0) and needs_costs(True, "split", 0)
    assert not needs_costs(True, "cpu", 0) and not needs_costs(True, "gpu", 0)
    assert not needs_costs(False, "auto", 0)  # no GPU: prefill never streams
    assert needs_costs(False, "cpu", 2)  # fetch-or-compute plans with them


def _counted_loader(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def load(moe: object, device: torch.device) -> SplitCosts:
        calls.append(device.type)
        return EAGER

    monkeypatch.setattr(prefill_planner, "load_costs", load)
    return calls


def test_costs_are_loaded_when_the_llm_starts_never_in_a_request(
        tiny_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted_loader(monkeypatch)
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
              progress=False, max_seq_len=64, fetch_slots=2)
    assert calls == ["cpu"] and llm.runner.planner is not None
    assert llm.runner.planner.costs == EAGER
    llm.generate(list(range(1, 40)), max_tokens=3)
    llm.runner.place(0)  # between steps, with the costs there: none loaded again
    assert calls == ["cpu"]
    plain = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64, EngineConfig())
    assert plain.overlap is not None
    try:
        assert calls == ["cpu"]  # a CPU run without fetches never needs them
        assert plain.planner is not None and plain.planner.costs is None
    finally:
        plain.overlap.detach()


def test_an_all_resident_placement_loads_no_costs(tiny_dir: Callable[..., Path],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    calls = _counted_loader(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hetmoe.engine.executor.prefill_planner"):
        llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
                  progress=False, max_seq_len=64, fetch_slots=2, gpu_expert_bytes=1 << 40)
    runner = llm.runner
    assert runner.placement is not None and runner.placement.everything
    assert runner.planner is not None and runner.planner.everything
    assert calls == [] and runner.planner.costs is None  # no CPU expert work: nothing to weigh
    assert ("prefill: every routed expert is resident on the GPU (no CPU expert work, nothing "
            "to stream): no prefill costs loaded") in caplog.messages
    assert runner.overlap is not None and runner.overlap.placement is runner.placement
    assert all(link.pool is None for link in runner.overlap.placed.values())  # no fetch pool
    llm.generate(list(range(1, 40)), max_tokens=3)
    assert calls == []
    one = sum(expert_bytes(runner.overlap.cpu))  # one expert per layer: CPU work again
    runner.place(one)  # between steps: the costs are loaded now, for the pool and the planner
    assert calls == ["cpu"] and runner.planner.costs == EAGER
    assert runner.planner.resident == (1,) * len(runner.overlap.cpu)


def test_a_partial_placement_loads_the_costs_at_start(tiny_dir: Callable[..., Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted_loader(monkeypatch)
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
              progress=False, max_seq_len=64, fetch_slots=2, gpu_expert_bytes=0)
    assert llm.runner.overlap is not None and calls == ["cpu"]
    one = sum(expert_bytes(llm.runner.overlap.cpu))
    partial = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64,
                          EngineConfig(fetch_slots=2, gpu_expert_bytes=one))
    try:
        assert partial.placement is not None and not partial.placement.everything
        assert calls == ["cpu", "cpu"]  # a runner of its own loads its own at start
        assert partial.planner is not None and partial.planner.costs == EAGER
    finally:
        assert partial.overlap is not None
        partial.overlap.detach()


@pytest.mark.device
def test_a_gpu_llm_with_every_expert_resident_loads_no_costs(
        tiny_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted_loader(monkeypatch)
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", experts="cpu", progress=False,
              max_seq_len=2048)  # `auto`: the tiny experts all fit
    assert llm.runner.placement is not None and llm.runner.placement.everything
    llm.generate([1 + i % 500 for i in range(1500)], max_tokens=2)
    assert calls == []


@pytest.mark.device
def test_a_gpu_llm_loads_its_costs_once_at_start(tiny_dir: Callable[..., Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted_loader(monkeypatch)
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", experts="cpu", progress=False,
              max_seq_len=2048, gpu_expert_bytes=0)
    assert calls == ["cuda"]
    llm.generate([1 + i % 500 for i in range(1500)], max_tokens=2)  # a pass the planner weighs
    assert calls == ["cuda"]
