"""Streamed prefill with GPU-resident experts (the "GPU" is the CPU device here): only the misses
are copied, the logits equal the all-CPU prefill in stream and split passes, the CPU gets only
the experts neither resident nor streamed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import SplitCosts, plan_gpu_experts
from hetmoe.engine.placement.layer_stream import LayerStreamer
from hetmoe.engine.placement.slots import expert_bytes
from hetmoe.engine.placement.stream_plan import LayerPass, layer_pass
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.presets.tiny import FAMILIES

PROMPT = torch.randint(0, 200, (48,), generator=torch.Generator().manual_seed(3)).tolist()
"""A prompt long enough to route to every expert of the baby models' layers (48 x top-k)."""

STREAM_ATOL = 0.05
"""|Δlogits| of a streamed pass against the CPU's: each expert's output agrees to 1e-7, but the
parts are summed in another order, so a later layer's bf16 rounding of its input may flip (seen:
0.02 at one deepseek_v2 position, with or without a placement). A wrong staging index moves every
position by 0.75 or more."""


def _runner(llm: LLM, budget: int) -> ModelRunner:
    return ModelRunner(llm.model, llm.device, llm.dtype, 1, llm.max_seq_len,
                       EngineConfig(gpu_expert_bytes=budget, prefill_experts="cpu"))


def _prefill(runner: ModelRunner, streamed: int | None) -> torch.Tensor:
    """PROMPT's prefill logits [T, V]; `streamed`: inside a streamed pass of that many misses
    per layer (None: the runner's own path, its experts on the CPU)."""
    overlap = runner.overlap
    assert overlap is not None
    runner.lengths[0] = 0
    if streamed is None:
        return runner.prefill_logits(0, PROMPT)
    with overlap.streamed(len(PROMPT), streamed):
        return runner.prefill_logits(0, PROMPT)


@contextmanager
def _cpu_ids(runner: ModelRunner) -> Iterator[list[list[torch.Tensor]]]:
    """Per MoE layer, the expert ids of every CPU call the streamer submits."""
    assert runner.overlap is not None
    seen: list[list[torch.Tensor]] = [[] for _ in runner.overlap.cpu]
    for i, moe in enumerate(runner.overlap.cpu):
        original = moe.submit

        def counted(x: torch.Tensor, ids: torch.Tensor, *rest: object, _i: int = i,
                    _original: Callable[..., object] = original) -> object:
            seen[_i].append(ids.clone())
            return _original(x, ids, *rest)

        moe.submit = counted  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        for moe in runner.overlap.cpu:
            del moe.submit


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_passes_with_resident_experts_equal_the_cpu_prefill(
        engine: Callable[[str, str], LLM], family: str) -> None:
    llm = engine(family, "cpu")
    plain = _runner(llm, 0)
    try:
        assert plain.overlap is not None
        ref = _prefill(plain, None)
        per_expert = sum(expert_bytes(plain.overlap.cpu))
    finally:
        plain.overlap.detach()
    runner = _runner(llm, 3 * per_expert)  # 3 of each layer's 8 experts resident
    try:
        overlap = runner.overlap
        assert overlap is not None and runner.placement is not None
        assert runner.planner is not None and runner.planner.resident == (3,) * len(overlap.cpu)
        resident = [s.experts() for s in runner.placement.layers]
        for k in (5, 2):  # every miss streamed, then a split: 2 streamed, 3 on the CPU
            with _cpu_ids(runner) as seen:
                logits = _prefill(runner, k)
            assert overlap.streamer is not None
            assert overlap.streamer.copied_bytes == k * per_expert  # the misses alone
            delta = (logits - ref).abs().max().item()
            assert delta <= STREAM_ATOL, f"{family}, k={k}: |Δlogits| {delta:.3g}"
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))
            for i, calls in enumerate(seen):
                if k == 5:
                    assert not calls, f"layer {i}: a CPU job with every miss streamed"
                    continue
                misses = [e for e in range(8) if e not in resident[i]]
                cpu = set(misses[k:])
                assert len(calls) == 1
                assert set(calls[0].unique().tolist()) <= cpu | {-1}
    finally:
        runner.overlap.detach()


def test_a_pass_copies_only_the_misses_in_runs(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 0)
    try:
        overlap = runner.overlap
        assert overlap is not None
        per_expert = sum(expert_bytes(overlap.cpu))
        runner.place(3 * per_expert, counts=[torch.tensor([0, 9, 0, 9, 0, 0, 0, 9])] *
                     len(overlap.cpu))  # experts 1, 3 and 7 resident
        assert runner.placement is not None
        assert all(s.experts() == {1, 3, 7} for s in runner.placement.layers)
        streamer = LayerStreamer(overlap.cpu, torch.device("cpu"))
        streamer.begin(len(PROMPT), overlap.top_k, 8, runner.placement.layers)
        share = streamer.passes[0]
        assert share == LayerPass(8, (0, 2, 4, 5, 6), cpu=False)
        assert share.runs == [(0, 1, 0), (2, 1, 1), (4, 3, 2)]
        first_two = sum(expert_bytes(overlap.cpu)[:2])
        assert streamer.copied_bytes == 5 * first_two  # layers 0 and 1 queued
        assert streamer.bytes_per_pass() == 5 * per_expert
        # Layer 0's staging buffer holds experts 0, 2, 4, 5, 6 side by side, per NUMA group.
        at = 0
        for part, host in zip(streamer.parts[0], streamer.host[0], strict=True):
            b = part.expert_bytes
            for index, expert in enumerate(share.streamed):
                got = streamer.staging[0][at + index * b:at + (index + 1) * b]
                assert torch.equal(got, host[expert * b:(expert + 1) * b]), (expert, index)
            at += 5 * b
        streamer.begin(len(PROMPT), overlap.top_k, 2, runner.placement.layers)
        assert streamer.passes[0] == LayerPass(8, (0, 2), cpu=True)
        assert streamer.passes[0].local(torch.device("cpu")).tolist() == [0, -1, 1, -1, -1, -1,
                                                                           -1, -1, -1]
    finally:
        runner.overlap.detach()


def test_a_new_placement_frees_the_experts_a_streamed_pass_saw(
        engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 0)
    try:
        assert runner.overlap is not None
        per_expert = sum(expert_bytes(runner.overlap.cpu))
        runner.place(3 * per_expert)
        assert runner.placement is not None
        old = [weakref.ref(s) for s in runner.placement.layers]
        _prefill(runner, 2)  # a split pass: the streamer computes the resident experts too
        runner.place(0)  # e.g. pre-placement: `auto` must see the old slots' memory free
        gc.collect()
        assert [ref() for ref in old] == [None] * len(old)
        # the next pass streams with no placement: every miss is every expert
        _prefill(runner, 8)
        assert runner.overlap.streamer is not None
        assert runner.overlap.streamer.copied_bytes == 8 * per_expert
    finally:
        runner.overlap.detach()


def test_layer_pass_takes_the_first_misses_and_names_bad_input() -> None:
    assert layer_pass(6, (), 6) == LayerPass(6, (0, 1, 2, 3, 4, 5), cpu=False)
    assert layer_pass(6, (), 2) == LayerPass(6, (0, 1), cpu=True)
    assert layer_pass(6, {0, 1, 2, 3, 4, 5}, 3) == LayerPass(6, (), cpu=False)
    assert layer_pass(6, {5, 1}, 9).streamed == (0, 2, 3, 4)
    assert layer_pass(6, {5, 1}, 0) == LayerPass(6, (), cpu=True)
    with pytest.raises(ValueError, match=r"resident expert ids \[6\] outside \[0, 6\)"):
        layer_pass(6, {6}, 1)
    with pytest.raises(ValueError, match="streamed experts per layer must be >= 0, got -1"):
        layer_pass(6, (), -1)


def test_begin_names_a_placement_of_another_model() -> None:
    moe = CpuMoE(8, 64, 96, "int8")
    moe.load(torch.randn(8, 96, 64) * 0.1, torch.randn(8, 96, 64) * 0.1,
             torch.randn(8, 64, 96) * 0.1)
    streamer = LayerStreamer([moe, moe], torch.device("cpu"))
    with pytest.raises(ValueError, match="slots of 1 MoE layers for a model of 2"):
        streamer.begin(8, 2, 4, [object()])  # type: ignore[list-item]
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"gpu_experts must be in \[1, 8\], got"):
            streamer.begin(8, 2, bad)


def test_the_modes_count_the_misses_and_a_placement_change_starts_the_tuner_again(
        engine: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 0)
    try:
        overlap, planner = runner.overlap, runner.planner
        assert overlap is not None and planner is not None
        monkeypatch.setattr(planner, "can_stream", lambda: True)  # as on a GPU with room
        planner.costs = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
        per_expert = sum(expert_bytes(overlap.cpu))
        layers = len(overlap.cpu)
        planner.tuner.record(4096, 8, 1.0)
        runner.place(5 * per_expert)
        assert planner.tuner.measured == {}  # its timings were of no placement
        assert planner.resident == (5,) * layers
        assert planner.gpu_experts(4096, "gpu") == 3
        assert planner.gpu_experts(4096, "split") == plan_gpu_experts(
            4096, overlap.top_k, 8, planner.costs, 1, 2, [5] * layers)
        assert planner.gpu_experts(4096, "cpu") == 0
        assert planner.gpu_experts(4096, "auto") == plan_gpu_experts(
            4096, overlap.top_k, 8, planner.costs, resident=[5] * layers)
        runner.place(7 * per_expert)
        assert planner.gpu_experts(4096, "split") == 1  # one miss: no split exists
        runner.place(8 * per_expert)
        assert planner.gpu_experts(4096, "gpu") == 0  # every expert resident
    finally:
        runner.overlap.detach()
