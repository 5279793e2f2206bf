"""The routing record (ops/routing_record.py): each MoE layer's router calls during a forward pass
are the ids its experts were given, their counts a bincount of them, nothing recorded outside."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hetmoe import LLM
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.routing_record import record_routing

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def _prefill(llm: LLM, ids: list[int]) -> None:
    runner = llm.runner
    slot = runner.cache.allocate()
    try:
        runner.prefill(slot, ids)
    finally:
        runner.free(slot)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_the_record_is_the_ids_the_experts_were_given(
        family: str, engine: Callable[[str, str], LLM]) -> None:
    llm = engine(family, "torch")
    layers = moe_layers(llm.model)
    given: list[list[torch.Tensor]] = [[] for _ in layers]

    def recording(i: int, submit: Any) -> Any:
        def record(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
            given[i].append(ids.clone())
            return submit(x, ids, weights)
        return record

    for i, moe in enumerate(layers):
        moe.experts.submit = recording(i, moe.experts.submit)
    try:
        with record_routing(llm.model) as routing:
            assert routing.layers == layers
            _prefill(llm, PROMPT[:6])
            _prefill(llm, PROMPT)
    finally:
        for moe in layers:
            del moe.experts.submit  # the instance attribute: the class's method again
    top_k = layers[0].gate.config.top_k
    picks, counts = routing.picks(), routing.counts()
    for i, moe in enumerate(layers):
        assert [c.shape for c in routing.calls[i]] == [(6, top_k), (len(PROMPT), top_k)]
        assert torch.equal(picks[i], torch.cat(given[i])), f"MoE layer {i}"
        want = torch.bincount(picks[i].reshape(-1), minlength=moe.experts.spec.num_experts)
        assert torch.equal(counts[i], want) and int(counts[i].sum()) == 17 * top_k
    _prefill(llm, PROMPT)  # outside: the hooks are gone
    assert [len(c) for c in routing.calls] == [2] * len(layers)
    routing.clear()
    assert all(not calls for calls in routing.calls)
    experts = layers[0].experts.spec.num_experts
    assert routing.counts()[0].tolist() == [0] * experts  # nothing recorded: zeros [E]


def test_a_model_without_moe_layers_records_nothing() -> None:
    with record_routing(nn.Sequential(nn.Linear(4, 4))) as routing:
        assert routing.layers == [] and routing.picks() == [] and routing.counts() == []
