"""Fused decode (engine/executor/fused_decode.py, eager on the CPU) against the HF-layer path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from decode_steps import assert_same_greedy, greedy

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.fused_decode import explain_compile_errors
from hetmoe.engine.executor.layer_plan import plan_layers
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.kv_batch import KVBatch


def _run(llm: LLM, fused: bool, deferred: int) -> tuple[list[int], list[torch.Tensor], bool]:
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                         EngineConfig(deferred=deferred, fused_decode=fused))
    try:
        tokens, logits = greedy(runner, 6)
    finally:
        runner.overlap.detach()
    return tokens, logits, runner.fused is not None


@pytest.mark.parametrize(("family", "deferred"), [
    ("qwen3_moe", 0), ("qwen3_moe", 2), ("qwen2_moe", 1), ("mixtral", 0), ("deepseek_v2", 1)])
def test_fused_decode_matches_the_module_path(
    engine: Callable[[str, str], LLM], family: str, deferred: int
) -> None:
    llm = engine(family, "cpu")
    want_tokens, want, _ = _run(llm, fused=False, deferred=deferred)
    tokens, logits, used = _run(llm, fused=True, deferred=deferred)
    assert used, f"{family}: the fused path should fit"
    assert_same_greedy((tokens, logits), (want_tokens, want), family)


def test_unfit_model_keeps_the_module_path(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("deepseek_v3", "cpu")  # low-rank queries (q_a_proj): no fused form
    with pytest.raises(ValueError, match=r"decoder layer 0: fused decode needs MLA with q_proj"):
        plan_layers(llm.model)
    _, _, used = _run(llm, fused=True, deferred=0)
    assert not used


def test_fused_qkv_shares_the_projection_weights(engine: Callable[[str, str], LLM]) -> None:
    attn = engine("qwen2_moe", "cpu").model.model.layers[0].self_attn
    before = [p.weight.clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    weight, bias = attn.fused_qkv()
    assert torch.equal(weight, torch.cat(before)) and bias is not None  # Qwen2 has q/k/v biases
    assert attn.k_proj.weight.data_ptr() == weight[before[0].shape[0]].data_ptr()
    again, _ = attn.fused_qkv()
    assert again.data_ptr() == weight.data_ptr()  # no second copy


def test_compile_failures_name_the_way_out() -> None:
    from torch._dynamo.exc import BackendCompilerFailed

    def no_compiler(x: int) -> int:
        raise BackendCompilerFailed(None, RuntimeError("Failed to find C compiler"), None)

    def bad_shape(x: int) -> int:
        raise ValueError("shape mismatch")

    expected = (r"torch.compile of the decode step failed \(it needs Triton and a C compiler on "
                r"this machine\): RuntimeError: Failed to find C compiler; "
                r"LLM\(\.\.\., compile_decode=False\) runs the same step uncompiled")
    with pytest.raises(RuntimeError, match=expected):
        explain_compile_errors(no_compiler)(1)
    with pytest.raises(ValueError, match="shape mismatch"):  # not a compiler error: unchanged
        explain_compile_errors(bad_shape)(1)
    assert explain_compile_errors(lambda x: x + 1)(1) == 2


def test_before_layer_runs_before_each_decoder_layer(engine: Callable[[str, str], LLM]) -> None:
    """The hook a graph capture splits at: called with 0..L-1 in order, results unchanged."""
    llm = engine("qwen3_moe", "cpu")
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len)
    seen: list[int] = []
    try:
        slot = runner.cache.allocate()
        runner.prefill(slot, [1, 2, 3])
        kv = KVBatch(torch.tensor([slot]), torch.tensor([[3]]), 4)
        with runner.overlap.phase(decoding=True):
            want = runner.fused.forward(torch.tensor([[5]]), kv)
            got = runner.fused.forward(torch.tensor([[5]]), kv, seen.append)
    finally:
        runner.overlap.detach()
    assert seen == list(range(len(llm.model.model.layers)))
    assert torch.equal(got, want)


def test_graph_split_layer_is_checked() -> None:
    with pytest.raises(ValueError, match=r"graph_split_layer must be an integer >= 0, got -1"):
        EngineConfig(graph_split_layer=-1)
