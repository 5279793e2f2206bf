"""Resident experts that follow the traffic: hot experts promoted between steps, uniform
routing left alone, tokens unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from decode_steps import greedy

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.placement_plan import plan_placement
from hetmoe.engine.placement.placement_policy import TrafficPolicy
from hetmoe.engine.placement.slots import Placement, expert_bytes
from hetmoe.experts.cpu_moe import CpuMoE


def _placement(resident: int = 2) -> Placement:
    layers = [CpuMoE(8, 64, 64, weight_format="int8") for _ in range(2)]
    for moe in layers:
        moe.load(*(torch.randn(8, 64, 64).bfloat16() * 0.1 for _ in range(3)))
    plan = plan_placement([8, 8], expert_bytes(layers), resident * sum(expert_bytes(layers)))
    return Placement(layers, plan, torch.device("cpu"))


def _route(placement: Placement, counts: list[list[int]]) -> None:
    for slots, c in zip(placement.layers, counts, strict=True):
        slots.counts.copy_(torch.tensor(c))


def test_hot_experts_replace_cold_ones_and_uniform_routing_moves_nothing() -> None:
    placement = _placement()
    assert [s.resident for s in placement.layers] == [[0, 1], [0, 1]]
    policy = TrafficPolicy(placement, interval=2)
    assert all(s.counting for s in placement.layers)
    # Uniform routing (counts within noise): two updates, nothing moves.
    for _ in range(4):
        _route(placement, [[10, 12, 9, 11, 13, 10, 8, 12]] * 2)
        policy.after_step()
    assert policy.moves == 0 and [s.resident for s in placement.layers] == [[0, 1], [0, 1]]
    # Layer 0: expert 6 hot; layer 1: uniform. Counts read at one update act at the next.
    for _ in range(4):
        _route(placement, [[2, 30, 1, 0, 0, 0, 90, 0], [9, 9, 9, 9, 9, 9, 9, 9]])
        policy.after_step()
    assert policy.moves == 1
    assert placement.layers[0].resident == [6, 1] and placement.layers[1].resident == [0, 1]
    assert placement.layers[0].table.tolist() == [-1, 1, -1, -1, -1, -1, 0, -1, -1]
    moved = Placement([s.moe for s in placement.layers],
                      plan_placement([8, 8], [s.expert_bytes for s in placement.layers], 0),
                      torch.device("cpu"))
    assert moved.layers[0].slots == 0
    fresh = placement.layers[0].packed[0][: placement.layers[0].parts[0].expert_bytes]
    host = placement.layers[0].host[0]
    b = placement.layers[0].parts[0].expert_bytes
    assert torch.equal(fresh, host[6 * b:7 * b])  # slot 0 holds expert 6's bytes
    with pytest.raises(ValueError, match="interval and max_moves must be >= 1, got 0, 4"):
        TrafficPolicy(placement, interval=0)


def test_following_the_traffic_mid_generation_keeps_the_tokens(
        engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    ref_runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                             EngineConfig())
    try:
        ref, _ = greedy(ref_runner, 8)
    finally:
        ref_runner.overlap.detach()  # type: ignore[union-attr]
    per_layer = sum(expert_bytes(ref_runner.overlap.cpu))  # type: ignore[union-attr]
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                         EngineConfig(gpu_expert_bytes=2 * per_layer, placement_interval=1))
    try:
        assert runner.policy is not None and runner.placement is not None
        runner.policy = TrafficPolicy(runner.placement, 1, margin=1.0, min_excess=0)
        tokens, _ = greedy(runner, 8)
        assert tokens == ref
        assert runner.policy.moves > 0
    finally:
        runner.overlap.detach()  # type: ignore[union-attr]
