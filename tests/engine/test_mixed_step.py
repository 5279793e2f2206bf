"""Mixed steps: prompt chunks of several requests (in several padded passes) and the decode rows
of others run as ONE forward pass (one expert call per MoE layer), and give every request the
tokens and logits it gets alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe.engine.executor.prefill_batch import PrefillPass, StepLayout
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.step import PrefillChunk, StepPlan
from hetmoe.ops.kv_batch import KVBatch, RaggedKV
from hetmoe.presets.tiny import FAMILIES

RUNNING = [list(range(10, 15)), list(range(40, 51))]  # decoding when the mixed step runs
# Joining it: 17 tokens continued from 10 cached ones, 3 and 2 new: passes (17 + 3), (2).
SPLIT = 10
JOINING = [list(range(100, 127)), [7, 8, 9], [60, 61]]
FOLLOW = 3  # batched greedy steps after the mixed one


@dataclass
class Trace:
    """One request's outputs: the logits of its prompt's last chunk [T, V], the logits of each
    decode step [V], and its greedy tokens."""

    prefill: torch.Tensor
    decodes: list[torch.Tensor]
    tokens: list[int]


def alone(runner: ModelRunner, prompt: list[int], steps: int) -> Trace:
    """`prompt` prefilled alone (every position), then `steps` greedy decode steps."""
    slot = runner.cache.allocate()
    try:
        prefill = runner.prefill_logits(slot, prompt)
        trace = Trace(prefill, [], [int(prefill[-1].argmax())])
        for _ in range(steps):
            logits = runner.decode([slot], [trace.tokens[-1]])[0]
            trace.decodes.append(logits)
            trace.tokens.append(int(logits.argmax()))
        return trace
    finally:
        runner.free(slot)


def mixed(runner: ModelRunner) -> list[Trace]:
    """RUNNING prefilled and decoding; the mixed step: their decode rows + JOINING's chunks
    (JOINING[0] continued from SPLIT cached tokens); then FOLLOW batched steps of all."""
    slots = [runner.cache.allocate() for _ in RUNNING + JOINING]
    try:
        traces = []
        for slot, prompt in zip(slots, RUNNING, strict=False):
            logits = runner.prefill_logits(slot, prompt)
            traces.append(Trace(logits, [], [int(logits[-1].argmax())]))
        first = JOINING[0]
        runner.prefill(slots[2], first[:SPLIT])
        chunks = (PrefillChunk(slots[2], tuple(first[SPLIT:]), SPLIT, every_position=True),
                  *(PrefillChunk(s, tuple(p), every_position=True)
                    for s, p in zip(slots[3:], JOINING[1:], strict=True)))
        out = runner.step(StepPlan(tuple(slots[:2]), tuple(t.tokens[-1] for t in traces),
                                   prefills=chunks))
        assert out.logits is not None and out.logits.shape == (2, runner.vocab_size)
        for trace, logits in zip(traces, out.logits, strict=True):
            trace.decodes.append(logits)
            trace.tokens.append(int(logits.argmax()))
        traces += [Trace(x, [], [int(x[-1].argmax())]) for x in out.prefill_logits]
        for _ in range(FOLLOW):
            logits = runner.decode(slots, [t.tokens[-1] for t in traces])
            for trace, row in zip(traces, logits, strict=True):
                trace.decodes.append(row)
                trace.tokens.append(int(row.argmax()))
        return traces
    finally:
        for slot in slots:
            runner.free(slot)


def check_against_alone(runner: ModelRunner, atol: float) -> None:
    traces = mixed(runner)
    for i, prompt in enumerate(RUNNING + JOINING):
        running = i < len(RUNNING)
        want = alone(runner, prompt, FOLLOW + running)
        got = traces[i]
        assert got.tokens == want.tokens, f"request {i}"
        prefill = want.prefill if running or i != len(RUNNING) else want.prefill[SPLIT:]
        torch.testing.assert_close(got.prefill, prefill, rtol=0, atol=atol)
        for step, (g, w) in enumerate(zip(got.decodes, want.decodes, strict=True)):
            torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=f"request {i} step {step}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_step_gives_each_request_its_tokens_alone_torch_experts(
        family: str, llm_of: Callable[[str], LLM]) -> None:
    check_against_alone(llm_of(family).runner, atol=2e-5)


CPU_EXPERTS_ATOL = {"deepseek_v3": 2.5e-2}
"""|Δlogits| of a mixed step with CPU experts against each request alone, where 5e-3 is too
tight. The CPU kernels round each expert input to bf16 and are batch-invariant themselves;
the mixed step's attention moves an input by ~1e-6 in fp32, which here carries elements of 4
rows of the continued prompt (2 of its chunk, 2 decode steps) across a bf16 rounding boundary
before the last MoE layer (routed weights scaled by 2.5): 5e-3 on its chunk's logits, 1.8e-2
on one decode step's (0.16 % of max |logit| 11.3, the others' scale too; no token changes). A
matter of this baby's weights and prompts, as in test_batched_prefill.py's CPU_EXPERTS_ATOL."""


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixed_step_gives_each_request_its_tokens_alone_cpu_experts(
        family: str, tiny_dir: Callable[..., Any]) -> None:
    runner = LLM(tiny_dir(family), device="cpu", dtype="float32", experts="cpu",
                 progress=False).runner
    # bf16 expert inputs: a batch may round one differently (seen <= 7e-6 elsewhere)
    check_against_alone(runner, atol=CPU_EXPERTS_ATOL.get(family, 5e-3))


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_mixed_step_on_a_gpu_with_cpu_experts(family: str,
                                                tiny_dir: Callable[..., Any]) -> None:
    # Alone, decode rows replay CUDA graphs of the fused layers; in a mixed step they run on the
    # HF layers with the prompt chunks: same tokens, logits within the bf16 expert rounding.
    runner = LLM(tiny_dir(family), device="cuda", dtype="float32", experts="cpu",
                 progress=False, gpu_expert_bytes=0).runner
    assert runner.use_graphs
    check_against_alone(runner, atol=1e-2)


def test_a_mixed_step_calls_each_moe_layer_once(llm_of: Callable[[str], LLM]) -> None:
    llm = llm_of("qwen3_moe")
    calls: list[int] = []  # tokens per MoE call
    hooks = [m.register_forward_hook(
        lambda _m, a, _o: calls.append(a[0].numel() // a[0].shape[-1]))
        for m in llm.model.modules() if type(m).__name__ == "HybridMoE"]
    runner = llm.runner
    slots = [runner.cache.allocate() for _ in range(5)]
    try:
        runner.prefill(slots[0], RUNNING[0])
        runner.prefill(slots[1], RUNNING[1])
        calls.clear()
        chunks = (PrefillChunk(slots[2], tuple(JOINING[0][SPLIT:])),
                  *(PrefillChunk(s, tuple(p)) for s, p in zip(slots[3:], JOINING[1:],
                                                               strict=True)))
        out = runner.step(StepPlan(tuple(slots[:2]), (3, 4), greedy=True, prefills=chunks))
        assert out.tokens is not None and len(out.tokens) == 2
        assert [len(x) for x in out.prefill_logits] == [1, 1, 1]
        assert [runner.lengths[s] for s in slots] == [
            len(RUNNING[0]) + 1, len(RUNNING[1]) + 1, len(JOINING[0]) - SPLIT, 3, 2]
    finally:
        for hook in hooks:
            hook.remove()
        for slot in slots:
            runner.free(slot)
    # Passes (17 + 3 padded to 17) and (2), then 2 decode rows: one call of all 38 tokens.
    assert calls == [2 * 17 + 2 + 2] * len(hooks)


def test_step_layout_lays_out_passes_then_decode_rows() -> None:
    chunks = (PrefillChunk(4, (1, 2, 3), start=2), PrefillChunk(5, (6,)))
    passes = [PrefillPass((0,), 3), PrefillPass((1,), 1)]
    layout = StepLayout(chunks, tuple(passes), slots=(7, 1), token_ids=(8, 9), starts=(11, 5))
    assert layout.ragged and layout.rows == (0, 1) and layout.row_slots == [4, 5, 7, 1]
    ids, kv = layout.tensors(torch.device("cpu"))
    assert isinstance(kv, RaggedKV)
    assert ids.tolist() == [[1, 2, 3, 6, 8, 9]]
    assert kv.positions.tolist() == [[2, 3, 4, 0, 11, 5]]
    assert [(p.slots.tolist(), p.positions.tolist(), p.kv_len) for p in kv.parts] == [
        ([4], [[2, 3, 4]], 5), ([5], [[0]], 1), ([7, 1], [[11], [5]], 12)]
    hidden = torch.arange(6.0)[None, :, None]  # [1, T, 1]
    rows, decode = layout.split(hidden)
    assert [r[:, 0].tolist() for r in rows] == [[2.0], [3.0]]  # each chunk's last position
    assert decode[:, 0].tolist() == [4.0, 5.0]
    alone = StepLayout(chunks, (passes[0],))
    assert not alone.ragged
    ids, kv = alone.tensors(torch.device("cpu"))
    assert isinstance(kv, KVBatch) and ids.tolist() == [[1, 2, 3]]


def test_ragged_kv_checks_its_positions_cover_its_parts() -> None:
    part = KVBatch(torch.tensor([0]), torch.tensor([[0, 1]]), 2)
    with pytest.raises(ValueError, match=r"positions \(1, 3\) do not lay its parts' 2 tokens "
                                         r"in one row \(1, 2\)"):
        RaggedKV((part,), torch.zeros(1, 3, dtype=torch.int64))
