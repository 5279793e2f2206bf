"""Expert Deferral: the split, its limits, the pure-torch reference, and the overlap against it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from decode_steps import PROMPT, SAME_BACKEND_ATOL, greedy
from deferral_reference import DeferralReference

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.deferral import check_deferred, split_ids
from hetmoe.ops.moe import moe_layers

# C++ CPU kernels (bf16 activations) against torch experts in fp32.
CROSS_BACKEND_ATOL = 0.08


def test_split_ids_masks_the_other_part() -> None:
    ids = torch.tensor([[7, 3, 5, 1], [0, 2, 4, 6]])
    immediate, late = split_ids(ids, 1)
    assert immediate.tolist() == [[7, 3, 5, -1], [0, 2, 4, -1]]
    assert late.tolist() == [[-1, -1, -1, 1], [-1, -1, -1, 6]]
    assert ids.tolist() == [[7, 3, 5, 1], [0, 2, 4, 6]]  # input untouched


def test_check_deferred_keeps_two_immediate() -> None:
    check_deferred(6, 8)
    with pytest.raises(ValueError, match=r"deferred=3 leaves 1 immediate experts of the router's "
                       r"top-4; at least 2 must stay immediate \(deferred <= 2\)"):
        check_deferred(3, 4)
    with pytest.raises(ValueError, match="deferred must be a non-negative integer, got -1"):
        check_deferred(-1, 8)


def test_reference_at_zero_equals_no_deferral(engine: Callable[[str, str], LLM]) -> None:
    runner = engine("qwen3_moe", "torch").runner
    _, plain = greedy(runner, 3)
    _, ref = greedy(runner, 3, DeferralReference(runner.model, 0))
    for a, b in zip(plain, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("family", "deferred"), [("qwen3_moe", 1), ("qwen3_moe", 2),
                                                  ("deepseek_v2", 1), ("qwen2_moe", 2)])
def test_overlap_deferral_matches_the_reference(
    engine: Callable[[str, str], LLM], family: str, deferred: int
) -> None:
    cpu = engine(family, "cpu")
    # The formula on the same CPU backend (tight) and on torch experts (dtype tolerance).
    ref_same = greedy(cpu.runner, 4, DeferralReference(cpu.model, deferred))
    torch_runner = engine(family, "torch").runner
    ref_torch = greedy(torch_runner, 4, DeferralReference(torch_runner.model, deferred))
    _, no_deferral = greedy(cpu.runner, 4)
    runner = ModelRunner(cpu.model, cpu.device, cpu.dtype, 2, cpu.max_seq_len,
                         EngineConfig(deferred=deferred))
    try:
        tokens, logits = greedy(runner, 4)
    finally:
        runner.overlap.detach()
    assert tokens == ref_same[0] == ref_torch[0]
    for step, (ours, same, other) in enumerate(zip(logits, ref_same[1], ref_torch[1],
                                                   strict=True)):
        d_same = (ours - same).abs().max().item()
        d_torch = (ours - other).abs().max().item()
        assert d_same <= SAME_BACKEND_ATOL, f"step {step}: |Δ| vs reference {d_same:.3g}"
        assert d_torch <= CROSS_BACKEND_ATOL, f"step {step}: |Δ| vs torch reference {d_torch:.3g}"
    # Prefill never defers; decode does, so its logits move (the test is not vacuous).
    assert torch.equal(logits[0], no_deferral[0])
    pairs = zip(logits[1:], no_deferral[1:], strict=True)
    moved = max((a - b).abs().max().item() for a, b in pairs)
    assert moved > 1e-3


def test_last_moe_layer_defers_nothing(tiny_dir: Callable[..., object]) -> None:
    # One MoE layer = the last one: deferral must leave its output unchanged.
    llm = LLM(tiny_dir("qwen3_moe", num_layers=1), device="cpu", dtype="float32",
              experts="cpu", progress=False, max_seq_len=32)
    assert len(moe_layers(llm.model)) == 1
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, llm.max_seq_len,
                         EngineConfig(deferred=2))
    runner.overlap.detach()
    _, static_window = greedy(runner, 2)
    for moe in runner.overlap.layers:
        moe.runtime = runner.overlap
    _, deferred = greedy(runner, 2)
    for a, b in zip(static_window, deferred, strict=True):
        assert torch.equal(a, b)


def test_hybrid_runner_refuses_too_much_deferral(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("deepseek_v2", "cpu")  # top-3
    with pytest.raises(ValueError, match="deferred=2 leaves 1 immediate experts"):
        ModelRunner(llm.model, llm.device, llm.dtype, 1, llm.max_seq_len,
                    EngineConfig(deferred=2))


def test_a_changed_count_is_checked_where_it_is_set(engine: Callable[[str, str], LLM]) -> None:
    runner = engine("deepseek_v2", "cpu").runner  # top-3
    assert runner.overlap is not None
    with pytest.raises(ValueError, match=r"^deferred=2 leaves 1 immediate experts of the "
                       r"router's top-3"):
        runner.reset_graphs(2)
    assert runner.overlap.deferred == 0  # unchanged
    plain = engine("qwen3_moe", "torch").runner
    plain.reset_graphs(0)  # nothing deferred: nothing to refuse
    with pytest.raises(ValueError, match=r"^deferred=1 needs every MoE layer's routed experts in "
                       r"the cpu backend$"):
        plain.reset_graphs(1)


def test_a_step_that_raises_leaves_no_cpu_job_behind(engine: Callable[[str, str], LLM]) -> None:
    """A CPU decode step that fails after a layer submitted its deferred experts (here: the next
    layer's submit raises) must not leave that job queued: the next step would refuse to submit
    ("called twice without sync") or read a stale output. The step after the failure decodes
    exactly as a runner that never failed."""
    cpu = engine("qwen3_moe", "cpu")
    runner = ModelRunner(cpu.model, cpu.device, cpu.dtype, 2, cpu.max_seq_len,
                         EngineConfig(deferred=2))
    try:
        _, expected = greedy(runner, 2)
        runner.lengths[0] = 0
        logits = runner.prefill(0, PROMPT)
        experts = runner.overlap.layers[1].experts

        def fail(*args: object) -> None:
            raise RuntimeError("injected failure")

        experts.submit = fail  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected failure"):
            runner.decode([0], [int(logits.argmax())])
        del experts.submit  # the class's method again
        assert runner.lengths[0] == len(PROMPT)  # the failed step counted nothing
        out = runner.decode([0], [int(logits.argmax())])
        assert torch.equal(out[0], expected[1])
    finally:
        runner.overlap.detach()


def test_a_prefill_that_raises_between_submit_and_sync_leaves_no_job(
    engine: Callable[[str, str], LLM],
) -> None:
    """Prefill: a layer's shared experts raise while its routed experts run on the CPU; the next
    prefill submits again and gives the logits of a runner that never failed."""
    cpu = engine("qwen2_moe", "cpu")  # shared experts run between submit and sync
    runner = ModelRunner(cpu.model, cpu.device, cpu.dtype, 2, cpu.max_seq_len)
    try:
        expected = runner.prefill(0, PROMPT)
        layer = runner.overlap.layers[1]

        def fail(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("injected failure")

        layer.shared = fail  # type: ignore[method-assign]
        runner.lengths[0] = 0
        with pytest.raises(RuntimeError, match="injected failure"):
            runner.prefill(0, PROMPT)
        del layer.shared  # the class's method again
        runner.lengths[0] = 0
        assert torch.equal(runner.prefill(0, PROMPT), expected)
    finally:
        runner.overlap.detach()
