"""The "misses" deferral order in CUDA-graph decode (`pytest -m device` on a GPU host): graph decode
with experts resident on the GPU equals the eager reference formula (tests/engine/
deferral_reference.py, the same resident sets) within the GPU kernels' tolerance; with every
expert resident it equals exact decode and its graphs record no CPU job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from decode_steps import greedy
from deferral_reference import DeferralReference
from test_defer_order import place_pattern

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.slots import expert_bytes

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

LOGIT_ATOL = 0.05
"""GPU kernels against the CPU's on the same weights (tests/engine/test_placement_device.py)."""


def _runner(llm: LLM, budget: int, deferred: int) -> ModelRunner:
    return ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                       EngineConfig(deferred=deferred, defer_order="misses",
                                    gpu_expert_bytes=budget, graph_split_layer=1))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "mixtral"])
def test_graph_decode_deferring_misses_equals_the_reference(
        family: str, tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=64, max_batch=4, gpu_expert_bytes=0)
    assert llm.runner.overlap is not None
    per_layer = sum(expert_bytes(llm.runner.overlap.cpu))
    top_k = int(llm.model.config.num_experts_per_tok)
    # The reference's path: HF layers, each MoE layer's own step, no graphs (as
    # graph_device_checks.py's plain runner).
    plain = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                        EngineConfig(cuda_graphs=False, fused_decode=False, gpu_expert_bytes=0))
    assert plain.overlap is not None
    plain.overlap.detach()
    plain.overlap = None
    exact = greedy(plain, 4)
    for d in range(1, top_k - 1):
        for experts in (3, 10**6):
            runner = _runner(llm, experts * per_layer, d)
            assert runner.use_graphs and runner.placement is not None
            resident = [list(s) for s in runner.placement.plan.resident]
            try:
                ours = greedy(runner, 4)
                jobs = [len(g.jobs) for g in runner.graphs.values()]
            finally:
                runner.overlap.detach()  # type: ignore[union-attr]
            ref = exact if runner.placement.everything else \
                greedy(plain, 4, DeferralReference(llm.model, d, resident))
            label = f"{family} d={d} {experts} resident"
            assert ours[0] == ref[0], label
            delta = max((a - b).abs().max().item() for a, b in zip(ours[1], ref[1], strict=True))
            assert delta <= LOGIT_ATOL, f"{label}: |Δlogits| {delta:.3g}"
            if runner.placement.everything:
                assert jobs and all(j == 0 for j in jobs), label  # no CPU job, nothing late


@pytest.mark.parametrize("pattern", ["fpf", "pfp", "ffp"])
def test_graph_decode_with_layers_deferring_nothing_keeps_the_carry(
        pattern: str, tiny_dir: Callable[..., Path]) -> None:
    """Five MoE layers placed unevenly (f every expert, p some): graphs of layers that defer
    nothing (first, last, between partial ones) equal the reference formula."""
    llm = LLM(tiny_dir("qwen3_moe", num_layers=5), device="cuda", dtype="float32",
              experts="cpu", progress=False, max_seq_len=64, max_batch=4, gpu_expert_bytes=0)
    plain = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                        EngineConfig(cuda_graphs=False, fused_decode=False, gpu_expert_bytes=0))
    assert plain.overlap is not None
    plain.overlap.detach()
    plain.overlap = None
    for d in (1, 2):
        runner = _runner(llm, 0, d)
        try:
            resident = place_pattern(runner, pattern)
            assert runner.use_graphs
            ours = greedy(runner, 4)
            assert runner.graphs, "the decode steps replayed no graph"
        finally:
            runner.overlap.detach()  # type: ignore[union-attr]
        ref = greedy(plain, 4, DeferralReference(llm.model, d, resident))
        label = f"{pattern} d={d}"
        assert ours[0] == ref[0], label
        delta = max((a - b).abs().max().item() for a, b in zip(ours[1], ref[1], strict=True))
        assert delta <= LOGIT_ATOL, f"{label}: |Δlogits| {delta:.3g}"
