"""Layer-wise GPU prefill (engine/placement/layer_stream.py) against the CPU experts: device tests
(`pytest -m device` on a GPU host)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import SplitCosts
from hetmoe.engine.placement.slots import expert_bytes
from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]
CROSS_BACKEND_ATOL = 0.08
"""fp32 baby models: the CPU kernels and the GPU both round expert inputs to bf16, each its own
way; tokens must still agree."""


def prefill_both(runner: ModelRunner, ids: list[int],
                 mode: str = "gpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits [T, V] with the experts on the GPU (`mode` "gpu": streamed, "split": with
    the CPU), then on the CPU."""
    out = []
    for where in (mode, "cpu"):
        runner.config = dataclasses.replace(runner.config, prefill_experts=where)
        slot = runner.cache.allocate()
        try:
            out.append(runner.prefill_logits(slot, ids).cpu())
        finally:
            runner.free(slot)
    assert runner.overlap is not None and runner.overlap.streamer is not None
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["gpu", "split"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_prefill_equals_cpu_prefill(family: str, mode: str,
                                        tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=512, gpu_expert_bytes=0)  # streamed, not resident
    ids = torch.randint(0, llm.runner.vocab_size, (300,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    overlap = llm.runner.overlap
    planner = llm.runner.planner
    assert overlap is not None and planner is not None and planner.can_stream()
    # Costs of equal CPU and GPU work per expert: a split near the middle.
    planner.costs = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
    experts = planner.gpu_experts(len(ids), mode)
    total = cpu_moe_of(overlap.layers[0].experts).num_experts
    assert 0 < experts <= total and (mode == "gpu") == (experts == total)
    gpu, cpu = prefill_both(llm.runner, ids, mode)
    assert overlap.streamer is not None and overlap.streamer.gpu_experts == experts
    # The CPU's share of a split layer started in stream order, in the pass's shared pinned
    # buffers (the prompt is longer than the host links' rows): the host waited for no layer.
    assert len(ids) > overlap.host[0].out.shape[0]
    assert overlap.streamer.share.host_waits == 0
    worst = (gpu - cpu).abs().amax(-1)  # [T]: per position
    # A position where bf16 rounding flips a near-tie of some router differs by more; a wrong
    # layout, expert or weight would move every position.
    assert (worst <= CROSS_BACKEND_ATOL).float().mean() >= 0.95, worst.sort().values[-20:]
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.97


def test_a_16k_token_prompt(tiny_dir: Callable[..., Path]) -> None:
    """Layer-major over the whole prompt, flash attention (no [S, S] mask): 16K tokens fit."""
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=16384 + 64, gpu_expert_bytes=0)
    ids = torch.randint(0, llm.runner.vocab_size, (16384,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    runner = llm.runner
    gpu, cpu = (torch.stack([row[0], row[-1]]) for row in prefill_both(runner, ids))
    assert (gpu - cpu).abs().max() <= CROSS_BACKEND_ATOL
    out = llm.generate(ids, max_new_tokens=4)  # decode goes on from the long prompt
    assert len(out.token_ids) == 4


def _logits(runner: ModelRunner, ids: list[int], mode: str) -> torch.Tensor:
    """Prefill logits [T, V] with `prefill_experts` = `mode`."""
    runner.config = dataclasses.replace(runner.config, prefill_experts=mode)
    slot = runner.cache.allocate()
    try:
        return runner.prefill_logits(slot, ids).cpu()
    finally:
        runner.free(slot)


@pytest.mark.parametrize("mode", ["gpu", "split"])
@pytest.mark.parametrize("family", FAMILIES)
def test_resident_experts_stream_only_the_misses(family: str, mode: str,
                                                 tiny_dir: Callable[..., Path]) -> None:
    """3 experts of each layer resident: a streamed or split pass copies only the misses (the
    streamer counts the bytes it queued) and its logits equal the all-CPU prefill's."""
    llm = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=512, gpu_expert_bytes=0)
    ids = torch.randint(0, llm.runner.vocab_size, (300,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    runner, overlap, planner = llm.runner, llm.runner.overlap, llm.runner.planner
    assert overlap is not None and planner is not None and planner.can_stream()
    cpu = _logits(runner, ids, "cpu")  # no placement: every expert on the CPU
    per_expert = sum(expert_bytes(overlap.cpu))  # one expert of every layer
    runner.place(3 * per_expert)
    assert planner.resident == (3,) * len(overlap.cpu)
    planner.costs = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
    misses = cpu_moe_of(overlap.layers[0].experts).num_experts - 3
    k = planner.gpu_experts(len(ids), mode)
    assert k == misses if mode == "gpu" else 0 < k < misses
    gpu = _logits(runner, ids, mode)
    assert overlap.streamer is not None and overlap.streamer.gpu_experts == k
    assert overlap.streamer.copied_bytes == k * per_expert
    assert overlap.streamer.bytes_per_pass() == misses * per_expert
    worst = (gpu - cpu).abs().amax(-1)  # [T]: per position
    assert (worst <= CROSS_BACKEND_ATOL).float().mean() >= 0.95, worst.sort().values[-20:]
    assert (gpu.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.97


def test_a_new_placement_frees_the_experts_a_streamed_pass_saw(
        tiny_dir: Callable[..., Path]) -> None:
    """Pre-placement re-places after its sampled prefills: `auto` must find the old resident
    experts' memory free, so the streamer must not keep their slots past the placement."""
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=512, gpu_expert_bytes=0, prefill_experts="gpu")
    runner = llm.runner
    assert runner.overlap is not None
    plan = runner.place(3 * sum(expert_bytes(runner.overlap.cpu)))  # 3 of 8 per layer
    slot = runner.cache.allocate()
    runner.prefill(slot, list(range(1, 300)))
    runner.free(slot)
    assert runner.overlap.streamer is not None and runner.overlap.streamer.gpu_experts == 5
    before = torch.cuda.memory_allocated()
    runner.place(0)
    assert before - torch.cuda.memory_allocated() >= plan.bytes


def test_graph_decode_after_a_split_prefill_binds_its_own_buffers_again(
        tiny_dir: Callable[..., Path]) -> None:
    """A split pass longer than the host links' rows binds each layer's CPU experts to the
    pass's shared buffers (`HostLink.start_wide`); the decode graphs after it must bind each
    link's own buffers again, or their CPU jobs would read the pass's stale rows."""
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=512, gpu_expert_bytes=0)
    runner, overlap = llm.runner, llm.runner.overlap
    assert overlap is not None and runner.planner is not None and runner.use_graphs
    runner.planner.costs = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
    ids = torch.randint(0, runner.vocab_size, (300,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    follow = [5, 9, 11, 2]  # teacher-forced decode inputs, the same after either prefill
    logits = {}
    for mode in ("cpu", "split", "cpu"):
        runner.config = dataclasses.replace(runner.config, prefill_experts=mode)
        slot = runner.cache.allocate()
        try:
            runner.prefill(slot, ids)
            if mode == "split":
                assert overlap.streamer is not None and overlap.streamer.share.host_waits == 0
            logits[mode] = torch.stack([runner.decode((slot,), (t,))[0].cpu() for t in follow])
        finally:
            runner.free(slot)
        for link in overlap.host:  # the graphs' replays bound the links' own rows again
            assert link.moe._bound[0].data_ptr() == link.x.data_ptr()
    assert (logits["split"] - logits["cpu"]).abs().max() <= CROSS_BACKEND_ATOL
