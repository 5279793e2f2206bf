"""Overlap path (C++ CPU experts, submit/shared/sync) against the torch reference, and d=0."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from decode_steps import SAME_BACKEND_ATOL, greedy

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.step import StepPlan
from hetmoe.ops.moe import moe_layers

# The CPU kernels round activations to bf16: fp32 baby logits agree with torch's to ~3e-2, except
# where bf16 flips a near-tie of the router (then the CPU backend itself differs from torch, with
# or without overlap); so decode steps are compared with the plain runner on the same backend.
LOGIT_ATOL = 0.08

def hybrid(llm: LLM, deferred: int = 0) -> ModelRunner:
    return ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                       EngineConfig(deferred=deferred, gpu_expert_bytes=0))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "mixtral", "qwen2_moe"])
def test_hybrid_path_matches_the_reference_paths(
    engine: Callable[[str, str], LLM], family: str
) -> None:
    ref_tokens, ref_logits = greedy(engine(family, "torch").runner, 6)
    llm = engine(family, "cpu")
    plain_tokens, plain_logits = greedy(llm.runner, 6)
    runner = hybrid(llm)
    try:
        tokens, logits = greedy(runner, 6)
    finally:
        runner.overlap.detach()
    assert tokens == ref_tokens == plain_tokens
    prefill = (logits[0] - ref_logits[0]).abs().max().item()
    assert prefill <= LOGIT_ATOL, f"{family} prefill: max |Δlogits| vs torch {prefill:.3g}"
    for step, (ours, plain) in enumerate(zip(logits, plain_logits, strict=True)):
        delta = (ours - plain).abs().max().item()
        assert delta <= SAME_BACKEND_ATOL, f"{family} step {step}: max |Δlogits| {delta:.3g}"


def test_deferred_zero_is_bit_identical_to_no_overlap(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("deepseek_v2", "cpu")  # shared experts + a dense first layer
    runner = hybrid(llm, deferred=0)
    try:
        _, with_overlap = greedy(runner, 4)
        runner.overlap.detach()  # the layers' own forward, same static-window decode
        _, without = greedy(runner, 4)
    finally:
        runner.overlap.detach()
    for step, (a, b) in enumerate(zip(with_overlap, without, strict=True)):
        assert torch.equal(a, b), f"step {step}: d=0 differs from no overlap"


def test_torch_experts_get_no_overlap_and_refuse_deferral(
    engine: Callable[[str, str], LLM]
) -> None:
    llm = engine("qwen3_moe", "torch")
    assert hybrid(llm).overlap is None  # the HF layers, each MoE layer on its plain step
    with pytest.raises(ValueError, match="deferred=1 needs every MoE layer's routed experts in "
                       "the cpu backend"):
        hybrid(llm, deferred=1)
    for moe in moe_layers(llm.model):
        assert moe.step is None


def test_cpu_moe_of_finds_the_backend_engine(engine: Callable[[str, str], LLM]) -> None:
    layers = moe_layers(engine("mixtral", "cpu").model)
    found = {id(cpu_moe_of(m.experts)) for m in layers}
    assert len(found) == len(layers) == 2


def test_a_step_starting_more_cpu_jobs_than_the_pool_queues_is_refused(
    engine: Callable[[str, str], LLM]
) -> None:
    from hetmoe import _cpu

    runner = hybrid(engine("qwen3_moe", "cpu"))
    try:
        runner.overlap.begin_capture()
        assert runner.overlap.recorded is not None
        runner.overlap.recorded.extend([runner.overlap.direct[0]] * 257)  # type: ignore[list-item]
        with pytest.raises(RuntimeError, match=r"a decode step starts 257 CPU jobs \(2 MoE "
                           r"layers, deferred=0\) but the CPU pool queues 256"):
            runner.overlap.end_capture()
        assert _cpu.POOL_QUEUE_CAPACITY == 256
    finally:
        runner.overlap.detach()


def test_graph_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"graph_batch_sizes must be positive integers, got \(0,"):
        EngineConfig(graph_batch_sizes=(0, 2))


def test_cuda_graphs_fall_back_to_eager_on_cpu(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = hybrid(llm)
    try:
        assert not runner.use_graphs  # asked for graphs; a CPU device runs the steps eagerly
        greedy(runner, 2)
        assert runner.graphs == {}
    finally:
        runner.overlap.detach()


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_and_eager_tokens_equal_on_cuda(tiny_dir: Callable[..., object]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=64, gpu_expert_bytes=0)
    runner = hybrid(llm)
    graph_tokens, _ = greedy(runner, 8)
    runner.use_graphs = False
    eager_tokens, _ = greedy(runner, 8)
    assert graph_tokens == eager_tokens


class FakeSteps:
    """Stands in for `ModelRunner._launch` / `_read` (CUDA only): step n's token is 100 + n in
    every row; records launches and reads, so the scheduling of steps launched ahead is seen."""

    def __init__(self, runner: ModelRunner, fail_at: int | None = None) -> None:
        self.runner, self.fail_at = runner, fail_at
        self.events: list[str] = []
        self.launched = 0

    def launch(self, slots: tuple[int, ...], ids: object) -> SimpleNamespace:
        n, self.launched = self.launched, self.launched + 1
        self.events.append(f"launch {n}")
        for slot in slots:
            self.runner.lengths[slot] += 1
        return SimpleNamespace(n=n, slots=slots, token=n, jobs=[f"jobs of {n}"])

    def read(self, step: SimpleNamespace) -> tuple[int, ...]:
        self.events.append(f"read {step.n}")
        step.jobs = []  # as `_read`: a step's jobs are waited even when one fails
        if step.n == self.fail_at:
            raise RuntimeError("CPU experts of MoE layer 0: injected")
        return (100 + step.n,) * len(step.slots)


def fake_greedy(runner: ModelRunner, fail_at: int | None = None) -> tuple[FakeSteps, int]:
    """The stand-ins installed on `runner`, and a slot prefilled with 3 tokens."""
    slot = runner.cache.allocate()
    runner.prefill(slot, [3, 4, 5])
    fake = FakeSteps(runner, fail_at)
    runner.use_graphs = True  # the greedy loop's scheduling, without a GPU
    runner._launch = fake.launch  # type: ignore[method-assign,assignment]
    runner._read = fake.read  # type: ignore[method-assign,assignment]
    return fake, slot


def test_greedy_steps_are_launched_one_ahead_and_the_unread_one_is_dropped(
    engine: Callable[[str, str], LLM]
) -> None:
    runner = hybrid(engine("qwen3_moe", "cpu"))
    try:
        fake, slot = fake_greedy(runner)
        steps = runner.greedy(slot, 7)
        assert [next(steps), next(steps)] == [100, 101]
        assert fake.events == ["launch 0", "launch 1", "read 0", "launch 2", "read 1"]
        steps.close()  # step 2 was launched ahead and is never read: waited, length rolled back
        assert fake.events[-1] == "read 2" and runner.lengths[slot] == 3 + 2
        fake.events.clear()
        assert list(runner.greedy(slot, 7, limit=2)) == [103, 104]
        assert fake.events == ["launch 3", "launch 4", "read 3", "read 4"]  # none beyond limit
        assert runner.lengths[slot] == 3 + 4
        runner.lengths[slot] = runner.max_seq_len - 1
        assert list(runner.greedy(slot, 7)) == [105]  # the window's last position
    finally:
        runner.overlap.detach()


def test_a_plan_that_does_not_continue_the_step_ahead_discards_it(
    engine: Callable[[str, str], LLM]
) -> None:
    runner = hybrid(engine("qwen3_moe", "cpu"))
    try:
        fake, slot = fake_greedy(runner)
        assert runner.step(StepPlan((slot,), (7,), greedy=True, ahead=True)).tokens == (100,)
        assert runner.committed(slot) == 3 + 1 and runner.lengths[slot] == 3 + 2
        # Another input than the token read: the step ahead is waited, rolled back, relaunched.
        assert runner.step(StepPlan((slot,), (9,), greedy=True)).tokens == (102,)
        assert fake.events == ["launch 0", "launch 1", "read 0", "read 1", "launch 2", "read 2"]
        assert runner.lengths[slot] == 3 + 2
    finally:
        runner.overlap.detach()


def test_a_failed_greedy_step_releases_the_step_launched_ahead(
    engine: Callable[[str, str], LLM]
) -> None:
    runner = hybrid(engine("qwen3_moe", "cpu"))
    try:
        _, slot = fake_greedy(runner, fail_at=1)
        aborted: list[list[object]] = []
        runner.overlap.abort_step = lambda inflight=(): aborted.append(list(inflight))  # type: ignore[method-assign]
        steps = runner.greedy(slot, 7)
        assert next(steps) == 100
        with pytest.raises(RuntimeError, match="injected"):
            next(steps)
        assert aborted == [["jobs of 2"]]  # the step launched ahead is released with the rest
        assert runner.lengths[slot] == 3 + 1  # the failed step and the one ahead rolled back
    finally:
        runner.overlap.detach()


@pytest.mark.parametrize("parts", [1, 2])
def test_a_step_queues_its_cpu_jobs_before_a_launch_that_could_block(
    engine: Callable[[str, str], LLM], parts: int
) -> None:
    """A step captured as one graph queues its CPU jobs before the launch (a long launch blocks
    once the GPU waits on a done word whose job is not queued: a deadlock); a split step launches
    its short first part, queues the jobs, then launches the rest. CUDA calls stood in for."""
    from hetmoe.engine.executor.graphs import GraphCache, _Graph
    from hetmoe.ops.kv_batch import KVBatch, window_bucket

    runner = hybrid(engine("qwen3_moe", "cpu"))
    events: list[str] = []

    class Part:
        def __init__(self, n: int) -> None:
            self.n = n

        def replay(self) -> None:
            events.append(f"launch {self.n}")

    try:
        assert runner.overlap is not None
        # The graph branch; nothing here touches a GPU.
        runner.graph_cache = GraphCache(runner.config, torch.device("cuda"), runner.overlap,
                                        runner._step_forward)
        runner.use_graphs = True
        width = window_bucket(6, runner.config.smallest_window, runner.max_seq_len)
        ids, pos, slots = torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), 5), \
            torch.zeros(1, dtype=torch.int64)
        runner.graphs[1, width] = _Graph([Part(n) for n in range(parts)], ids.clone(),  # type: ignore[misc]
                                         pos.clone(), slots.clone(), torch.zeros(1, 1, 8), [])
        runner.overlap.submit_recorded = lambda jobs: events.append("queue jobs")  # type: ignore[method-assign]
        with runner.overlap.phase(decoding=True):
            runner._decode_forward(ids, KVBatch(slots, pos, 6))
        want = ["queue jobs", "launch 0"] if parts == 1 else ["launch 0", "queue jobs", "launch 1"]
        assert events == want
    finally:
        runner.overlap.detach()
