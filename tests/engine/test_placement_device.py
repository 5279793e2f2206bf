"""GPU-resident experts in CUDA-graph decode (`pytest -m device` on a GPU host): the same tokens
as every expert on the CPU, with and without deferral, batch 1 and 3; no CPU job recorded in a
graph when every expert is resident; a placement change between graph replays."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from decode_steps import PROMPT

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.slots import expert_bytes

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

LOGIT_ATOL = 0.05
"""GPU kernels against the CPU's on the same weights, as benchmarks/engine/check_graph_device.py's
OTHER_KERNELS_ATOL (seen: up to 0.03 on the baby models, tokens equal)."""


def _decode(runner: ModelRunner, batch: int, steps: int = 4) -> tuple[list[list[int]],
                                                                        list[torch.Tensor]]:
    slots = list(range(batch))
    tokens = []
    for s in slots:
        runner.lengths[s] = 0
        tokens.append([int(runner.prefill(s, PROMPT[: 3 + s]).argmax())])
    logits = []
    for _ in range(steps):
        out = runner.decode(slots, [t[-1] for t in tokens])
        logits.append(out.float().cpu())
        for t, row in zip(tokens, out, strict=True):
            t.append(int(row.argmax()))
    return tokens, logits


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3",
                                    "mixtral"])
def test_graph_decode_with_resident_experts_equals_all_cpu(
        family: str, tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=64, max_batch=4, gpu_expert_bytes=0)
    assert llm.runner.placement is None
    top_k = int(llm.model.config.num_experts_per_tok)
    for d in sorted({0, min(2, top_k - 2)}):
        # The score order: the same deferred set whatever is resident (the default "misses"
        # order's: tests/engine/test_defer_order_device.py).
        base = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                           EngineConfig(deferred=d, gpu_expert_bytes=0, graph_split_layer=1,
                                        defer_order="score"))
        assert base.use_graphs
        per_layer = sum(expert_bytes(base.overlap.cpu))  # type: ignore[union-attr]
        want = {b: _decode(base, b) for b in (1, 3)}
        base.overlap.detach()  # type: ignore[union-attr]
        for experts in (3, 10**6):
            runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                                 EngineConfig(deferred=d, gpu_expert_bytes=experts * per_layer,
                                              graph_split_layer=1, defer_order="score"))
            assert runner.placement is not None
            for b in (1, 3):
                tokens, logits = _decode(runner, b)
                assert tokens == want[b][0], f"{family} d={d} {experts} resident, batch {b}"
                delta = max((x - y).abs().max().item()
                            for x, y in zip(logits, want[b][1], strict=True))
                assert delta <= LOGIT_ATOL, f"{family} d={d} batch {b}: |Δlogits| {delta:.3g}"
            jobs = [len(g.jobs) for g in runner.graphs.values()]
            layers = len(runner.placement.layers)
            if runner.placement.everything:
                assert jobs and all(j == 0 for j in jobs)
            else:
                assert jobs and all(j == layers for j in jobs)
            runner.overlap.detach()  # type: ignore[union-attr]


def test_a_placement_change_between_replays_keeps_the_tokens(
        tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=64, max_batch=4, gpu_expert_bytes=0)
    runner = llm.runner
    want, _ = _decode(runner, 1, 8)
    per_layer = sum(expert_bytes(runner.overlap.cpu))  # type: ignore[union-attr]
    runner.place(2 * per_layer)
    runner.lengths[0] = 0
    tokens = [int(runner.prefill(0, PROMPT[:3]).argmax())]
    for step in range(8):
        if step == 3:
            assert runner.placement is not None
            slots = runner.placement.layers[0]
            slots.move(0, 7, torch.cuda.Stream())  # a copy on a side stream, between replays
            assert slots.resident[0] == 7
        tokens.append(int(runner.decode([0], [tokens[-1]])[0].argmax()))
    assert [tokens] == want
