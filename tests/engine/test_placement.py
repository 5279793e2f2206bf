"""GPU-resident experts (the "GPU" is the CPU device here): the slots' compute against the CPU
backend per format, decode equal to all-CPU decode, no CPU job when everything is resident, and
placement changes between steps that keep the tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from decode_steps import PROMPT, SAME_BACKEND_ATOL, assert_same_greedy, greedy

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement import placement_compute
from hetmoe.engine.placement.placement_plan import slot_table
from hetmoe.engine.placement.slots import LayerSlots, expert_bytes
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.presets.tiny import FAMILIES

# Per format, max |resident compute + CPU misses - all on the CPU| relative to the output's
# scale: the CPU's int kernels quantize the activations too (int8 per row, int4 asymmetric),
# the resident compute takes them in bf16.
FORMAT_RTOL = {"bf16": 1e-5, "int8": 2e-2, "int4": 3e-2}


def _layer(fmt: str, seed: int = 0) -> CpuMoE:
    e, h, i = 8, 64, 96
    g = torch.Generator().manual_seed(seed)
    moe = CpuMoE(e, h, i, weight_format=fmt)
    gate, up = (torch.randn(e, i, h, generator=g) * 0.1 for _ in range(2))
    moe.load(gate.bfloat16(), up.bfloat16(), (torch.randn(e, h, i, generator=g) * 0.1).bfloat16())
    return moe


@pytest.mark.parametrize("fmt", sorted(FORMAT_RTOL))
@pytest.mark.parametrize("tokens", [1, 3, 40])  # pairs gathered; every slot unpacked (40 x 2)
def test_resident_pairs_plus_cpu_misses_equal_the_cpu_alone(fmt: str, tokens: int) -> None:
    moe = _layer(fmt)
    slots = LayerSlots(moe, [3, 0, 5], torch.device("cpu"))
    slots.counting = True
    assert slots.table.tolist() == [1, -1, -1, 0, -1, 2, -1, -1, -1]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g)
    ids = torch.randperm(8, generator=g)[:2].repeat(tokens, 1) if tokens == 1 else \
        torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    slot, cpu_ids = slots.split(ids)
    resident = torch.isin(ids, torch.tensor([3, 0, 5]))
    assert torch.equal(slot >= 0, resident)
    assert torch.equal(cpu_ids, torch.where(resident, -1, ids))
    assert torch.equal(slots.counts, torch.bincount(ids.flatten(), minlength=8))
    ours = slots.compute(x, ids, slot, weights) + moe.forward(x, cpu_ids, weights)
    ref = moe.forward(x, ids, weights)
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= FORMAT_RTOL[fmt], f"{fmt}, {tokens} tokens: relative error {err:.3g}"


def test_moving_an_expert_updates_its_bytes_and_the_table() -> None:
    moe = _layer("int8")
    slots = LayerSlots(moe, [3, 0], torch.device("cpu"))
    slots.move(1, 6)
    assert slots.resident == [3, 6]
    assert slots.table[[0, 3, 6]].tolist() == [-1, 0, 1]
    moved = LayerSlots(moe, [3, 6], torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(slots.packed, moved.packed, strict=True))
    with pytest.raises(ValueError, match="expert 3 already has slot 0"):
        slots.move(1, 3)
    with pytest.raises(ValueError, match="slot 2 of 2, expert 1 of 8"):
        slots.move(2, 1)


def test_a_slot_table_maps_each_expert_to_its_index_and_minus_one_to_minus_one() -> None:
    table = slot_table(6, [4, 1])  # [E + 1]
    assert table.tolist() == [-1, 1, -1, -1, 0, -1, -1]
    assert table[torch.tensor([[4, -1], [1, 2]])].tolist() == [[0, -1], [1, -1]]
    assert slot_table(3, []).tolist() == [-1, -1, -1, -1]


def _runner(llm: LLM, budget: int | str, deferred: int = 0,
            defer_order: str = "misses") -> ModelRunner:
    return ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                       EngineConfig(gpu_expert_bytes=budget, deferred=deferred,
                                    defer_order=defer_order))


def _layer_bytes(runner: ModelRunner, experts: int) -> int:
    assert runner.overlap is not None
    return experts * sum(expert_bytes(runner.overlap.cpu))


@contextmanager
def _counted_submits(llm: LLM) -> Iterator[list[int]]:
    """Counts the CPU backend's submits (every CPU job of the Python links)."""
    calls = [0]
    layers = [m.experts for m in llm.model.modules() if hasattr(m, "experts")
              and hasattr(m.experts, "submit")]
    for experts in layers:
        original = experts.submit

        def counted(*args: object, _original: Callable[..., object] = original) -> object:
            calls[0] += 1
            return _original(*args)

        experts.submit = counted
    try:
        yield calls
    finally:
        for experts in layers:
            del experts.submit


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_decode_equals_all_cpu_decode(engine: Callable[[str, str], LLM],
                                               family: str) -> None:
    llm = engine(family, "cpu")
    plain = _runner(llm, 0)
    try:
        assert plain.placement is None and not plain.overlap.placed
        ref = greedy(plain, 5)
    finally:
        plain.overlap.detach()
    for experts in (3, 8):  # some experts of each layer, then all
        runner = _runner(llm, _layer_bytes(runner=plain, experts=experts))
        try:
            assert runner.placement is not None
            assert [s.slots for s in runner.placement.layers] == \
                [experts] * len(runner.placement.layers)
            ours = greedy(runner, 5)
        finally:
            runner.overlap.detach()
        assert_same_greedy(ours, ref, f"{family}, {experts} resident")


def test_everything_resident_submits_no_cpu_job(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 10**12)
    try:
        assert runner.placement is not None and runner.placement.everything
        with _counted_submits(llm) as calls:
            greedy(runner, 3)
        assert calls[0] == 0
        runner.place(_layer_bytes(runner, 7))  # one expert per layer back on the CPU
        assert runner.placement is not None
        for slots in runner.placement.layers:
            slots.counting = True
        with _counted_submits(llm) as calls:
            greedy(runner, 3)
        layers = len(runner.placement.layers)
        assert calls[0] == 4 * layers  # prefill + 3 decode steps, one job per layer each
        counts = runner.placement.counts()
        assert all(int(c.sum()) > 0 for c in counts)
    finally:
        runner.overlap.detach()


def test_a_placement_change_mid_generation_keeps_the_tokens(
        engine: Callable[[str, str], LLM]) -> None:
    llm = engine("deepseek_v2", "cpu")
    runner = _runner(llm, 0)
    try:
        ref, _ = greedy(runner, 6)
        runner.place(_layer_bytes(runner, 2))
        runner.lengths[0] = 0
        logits = runner.prefill(0, PROMPT)
        tokens = [int(logits.argmax())]
        for step in range(6):
            if step == 2:
                runner.place(_layer_bytes(runner, 5), counts=runner.placement.counts())
            if step == 4:
                runner.place(0)
                assert runner.placement is None
            tokens.append(int(runner.decode([0], [tokens[-1]])[0].argmax()))
        assert tokens == ref
    finally:
        runner.overlap.detach()


def test_auto_places_nothing_without_a_gpu(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("mixtral", "cpu")
    runner = _runner(llm, "auto")
    try:
        assert runner.placement is None and not runner.overlap.placed
    finally:
        runner.overlap.detach()
    assert EngineConfig().gpu_expert_bytes == "auto"  # what LLM() and every command get
    default = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len)
    try:  # no GPU: auto is 0, so every expert stays on the CPU and no link is wrapped
        assert default.placement is None and not default.overlap.placed
    finally:
        default.overlap.detach()


def test_the_former_budget_name_replaces_auto_and_zero_only() -> None:
    assert EngineConfig(prefill_resident_bytes=5).gpu_expert_bytes == 5
    assert EngineConfig(prefill_resident_bytes=5, gpu_expert_bytes=0).gpu_expert_bytes == 5
    assert EngineConfig(prefill_resident_bytes=5, gpu_expert_bytes=7).gpu_expert_bytes == 7
    assert EngineConfig(prefill_resident_bytes=0).gpu_expert_bytes == "auto"


def test_the_former_prefill_resident_bytes_places_experts(
        engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen2_moe", "cpu")
    plain = _runner(llm, 0)
    plain.overlap.detach()
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                         EngineConfig(prefill_resident_bytes=_layer_bytes(plain, 4)))
    try:
        assert runner.placement is not None
        assert [s.slots for s in runner.placement.layers] == [4] * len(runner.placement.layers)
    finally:
        runner.overlap.detach()


@pytest.mark.parametrize("deferred", [1, 2])
def test_resident_decode_with_deferral_equals_all_cpu_deferral(
        engine: Callable[[str, str], LLM], deferred: int) -> None:
    """In the score order the deferred set is the same whatever is resident (the default
    "misses" order's is not: tests/engine/test_defer_order.py checks it against its formula)."""
    llm = engine("qwen3_moe", "cpu")  # top-4: up to 2 deferred
    plain = _runner(llm, 0, deferred, "score")
    try:
        ref = greedy(plain, 5)
    finally:
        plain.overlap.detach()
    for experts in (3, 8):
        runner = _runner(llm, _layer_bytes(plain, experts), deferred, "score")
        try:
            ours = greedy(runner, 5)
        finally:
            runner.overlap.detach()
        assert_same_greedy(ours, ref, f"deferred={deferred}, {experts} resident")


def test_batched_decode_with_resident_experts_equals_all_cpu(
        engine: Callable[[str, str], LLM]) -> None:
    llm = engine("deepseek_v3", "cpu")
    rows: list[torch.Tensor] = []
    for experts in (0, 3):
        runner = _runner(llm, 0)
        if experts:
            runner.place(_layer_bytes(runner, experts))
        try:
            for slot, prompt in enumerate((PROMPT, PROMPT[:3])):
                runner.lengths[slot] = 0
                runner.prefill(slot, prompt)
            rows.append(runner.decode([0, 1], [7, 11]))
        finally:
            runner.overlap.detach()
    assert torch.equal(rows[0].argmax(-1), rows[1].argmax(-1))
    assert (rows[0] - rows[1]).abs().max().item() <= SAME_BACKEND_ATOL


def test_prefill_streams_nothing_when_every_expert_is_resident(
        engine: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 0)
    try:
        planner = runner.planner
        assert planner is not None
        monkeypatch.setattr(planner, "can_stream", lambda: True)  # as on a GPU with room
        assert planner.gpu_experts(4096, "gpu") == 8
        runner.place(_layer_bytes(runner, 5))
        assert planner.gpu_experts(4096, "gpu") == 3  # some resident: the misses stream
        runner.place(_layer_bytes(runner, 8))
        assert planner.gpu_experts(4096, "gpu") == 0  # all resident: nothing streamed
        with _counted_submits(llm) as calls:
            runner.lengths[0] = 0
            runner.prefill(0, PROMPT)
        assert calls[0] == 0
    finally:
        runner.overlap.detach()


@pytest.mark.parametrize(("setting", "want"), [("bf16", False), ("quantized", True)])
def test_the_gpu_expert_math_is_read_once_when_the_runner_is_built(
        engine: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch, setting: str,
        want: bool) -> None:
    """HETMOE_GPU_EXPERT_MATH reaches the resident slots and the streamer from the runner's
    build: a setting that would be refused afterwards is never read by a step's kernel calls."""
    llm = engine("qwen3_moe", "cpu")
    monkeypatch.setenv("HETMOE_GPU_EXPERT_MATH", setting)
    runner = _runner(llm, 0)
    try:
        runner.place(_layer_bytes(runner, 4))
        assert runner.placement is not None and runner.overlap.act_quant is want
        assert [s.act_quant for s in runner.placement.layers] == [want] * len(runner.overlap.cpu)
        assert runner.overlap.make_streamer().act_quant is want
        monkeypatch.setenv("HETMOE_GPU_EXPERT_MATH", "int8")  # refused if read again
        asked: list[bool] = []

        def kernel(*args: Any, act_quant: bool = False) -> torch.Tensor:
            asked.append(act_quant)
            return placement_compute.packed_pairs_torch(*args)

        monkeypatch.setattr(placement_compute, "use_kernel", lambda device, fmt: True)
        monkeypatch.setattr(placement_compute, "packed_moe", kernel)
        runner.lengths[0] = 0
        runner.prefill(0, PROMPT)
        assert asked and set(asked) == {want}
    finally:
        runner.overlap.detach()
