"""Decode steps of many rows streamed to a real GPU (`EngineConfig.stream_decode_rows`) against the
decode path on CUDA graphs: device tests (`pytest -m device` on a GPU host)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import TRIES, SplitCosts
from hetmoe.engine.step import StepPlan
from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]
ROWS = 12
"""Rows of every decode step (its own graph size: 12 pads to 16)."""
STEPS = 6
CROSS_BACKEND_ATOL = 0.08
"""fp32 baby models: the CPU kernels and the GPU round expert inputs to bf16 each its own way
(tests/engine/test_gpu_prefill.py)."""
EVEN = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
"""Costs of equal CPU and GPU work per expert: splits near the middle."""


def _runner(llm: LLM, rows: int, mode: str) -> ModelRunner:
    config = EngineConfig(stream_decode_rows=rows, prefill_experts=mode, gpu_expert_bytes=0,
                          compile_decode=False)  # graphs of the same functions, no compile wait
    runner = ModelRunner(llm.model, llm.device, llm.dtype, ROWS, 128, config)
    assert runner.planner is not None and runner.use_graphs
    if mode in ("auto", "split"):
        runner.planner.costs = EVEN
    return runner


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int
            ) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
    """Prompts prefilled, one sampled-plan step (logits [B, V]), then greedy steps launched ahead
    (graphs): every step's tokens, and the first step's logits."""
    try:
        slots = tuple(runner.cache.allocate() for _ in prompts)
        first = tuple(int(runner.prefill(s, p).argmax()) for s, p in zip(slots, prompts,
                                                                          strict=True))
        logits = runner.decode(slots, first).cpu()
        tokens = [first, tuple(logits.argmax(-1).tolist())]
        for _ in range(steps):
            out = runner.step(StepPlan(slots, tokens[-1], greedy=True, ahead=True)).tokens
            assert out is not None
            tokens.append(out)
        runner.settle()
        return tokens, [logits]
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()


def _rows_alike(ours: list[tuple[int, ...]], ref: list[tuple[int, ...]]) -> int:
    """Rows whose every step's token is the reference's (a near tie that one backend's rounding
    flips changes the rest of its row; a wrong pass would change every row)."""
    return sum(all(a[r] == b[r] for a, b in zip(ours, ref, strict=True)) for r in range(ROWS))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, vocab, (ROWS, 24), generator=g).tolist()


@pytest.mark.parametrize("mode", ["gpu", "split"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_decode_steps_equal_the_graph_decode_path(
        family: str, mode: str, tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu", progress=False,
              max_seq_len=128, gpu_expert_bytes=0)
    prompts = _prompts(llm.runner.vocab_size)
    ref_tokens, ref = _greedy(_runner(llm, 0, mode), prompts, STEPS)
    runner = _runner(llm, ROWS, mode)
    planner = runner.planner
    assert planner is not None and planner.decode_rows == ROWS
    k, timed = planner.decode_experts(ROWS, mode)
    assert k > 0 and not timed and (mode == "gpu") == (k == planner.misses)
    tokens, logits = _greedy(runner, prompts, STEPS)
    assert runner.overlap is not None and runner.overlap.streamer is not None
    assert runner.overlap.streamer.gpu_experts == k
    assert not [key for key in runner.graphs if key[0] >= ROWS]  # no decode graph of 12 rows
    worst = (logits[0] - ref[0]).abs().max().item()
    assert worst <= CROSS_BACKEND_ATOL, f"{family} {mode}: |Δlogits| {worst:.3g}"
    assert _rows_alike(tokens, ref_tokens) >= ROWS - 2, (tokens, ref_tokens)


def test_auto_weighs_graph_steps_against_streamed_ones_then_settles(
        tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=128, gpu_expert_bytes=0)
    prompts = _prompts(llm.runner.vocab_size)
    runner = _runner(llm, ROWS, "auto")
    planner = runner.planner
    assert planner is not None
    options = planner.decode_tuner.options(ROWS, planner.top_k, planner.num_experts, EVEN)
    weighing = TRIES * len(options)
    ref_tokens, _ = _greedy(_runner(llm, 0, "auto"), prompts, weighing + 4)
    tokens, _ = _greedy(runner, prompts, weighing + 4)
    measured = planner.decode_tuner.measured[planner.decode_tuner.bucket(ROWS)]
    # The sampled step is weighed too: every option has its TRIES timed steps.
    assert {k: len(t) for k, t in measured.items()} == dict.fromkeys(options, TRIES)
    assert planner.decode_experts(ROWS)[1] is False  # settled: no more timing
    assert _rows_alike(tokens, ref_tokens) >= ROWS - 2, (tokens, ref_tokens)


def test_a_split_decode_step_waits_on_the_host_once(tiny_dir: Callable[..., Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's share of each split layer starts and is awaited in stream order (host links):
    the host queues every layer, then sleeps once for the pass; nothing syncs per layer."""
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=128, gpu_expert_bytes=0)
    runner = _runner(llm, ROWS, "split")
    overlap = runner.overlap
    assert overlap is not None
    waits: list[str] = []
    event_sync = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize",
                        lambda self: (waits.append("event"), event_sync(self))[1])
    cpu_sync = type(overlap.cpu[0]).sync
    monkeypatch.setattr(type(overlap.cpu[0]), "sync",
                        lambda self, call=None: (waits.append("cpu"), cpu_sync(self, call))[1])
    try:
        slots = tuple(runner.cache.allocate() for _ in range(ROWS))
        prompts = _prompts(runner.vocab_size)
        first = tuple(int(runner.prefill(s, p).argmax()) for s, p in zip(slots, prompts,
                                                                          strict=True))
        runner.decode(slots, first)  # the streamer made (host memory registered)
        waits.clear()
        out = runner.step(StepPlan(slots, first, greedy=True)).tokens
        assert out is not None and len(out) == ROWS
        assert waits == ["event"], waits  # run_pass's one sleep until the pass is done
        assert overlap.pending == []  # its CPU jobs waited
    finally:
        overlap.detach()
