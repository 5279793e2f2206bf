"""Batched prefill: several prompts in one runner step give each the tokens and logits of
prefilling it alone; mixed prefill + decode steps equal separate ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe.engine.executor.prefill_batch import prefill_passes
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.step import PrefillChunk, StepPlan
from hetmoe.presets.tiny import FAMILIES

PROMPTS = [list(range(10, 15)), list(range(40, 51)), list(range(100, 117)), [7, 8, 9, 10]]
FOLLOW = 4  # greedy tokens after each prompt


def greedy_alone(runner: ModelRunner, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits [T, V] of `prompt` alone, then FOLLOW greedy tokens (one slot)."""
    slot = runner.cache.allocate()
    try:
        logits = runner.prefill_logits(slot, prompt)
        tokens = [int(logits[-1].argmax())]
        for _ in range(FOLLOW):
            tokens.append(int(runner.decode([slot], [tokens[-1]])[0].argmax()))
        return logits, tokens
    finally:
        runner.free(slot)


def greedy_together(runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every prompt prefilled in ONE step (every position's logits), then batched decode."""
    slots = [runner.cache.allocate() for _ in PROMPTS]
    try:
        chunks = tuple(PrefillChunk(s, tuple(p), every_position=True)
                       for s, p in zip(slots, PROMPTS, strict=True))
        logits = list(runner.step(StepPlan(prefills=chunks)).prefill_logits)
        tokens = [[int(x[-1].argmax())] for x in logits]
        for _ in range(FOLLOW):
            out = runner.decode(slots, [t[-1] for t in tokens])
            for row, t in enumerate(tokens):
                t.append(int(out[row].argmax()))
        return logits, tokens
    finally:
        for slot in slots:
            runner.free(slot)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_equals_each_prompt_alone_torch_experts(family: str, llm_of) -> None:
    runner = llm_of(family).runner
    logits, tokens = greedy_together(runner)
    for prompt, got, got_tokens in zip(PROMPTS, logits, tokens, strict=True):
        want, want_tokens = greedy_alone(runner, prompt)
        assert got_tokens == want_tokens
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


CPU_EXPERTS_ATOL = {"deepseek_v3": 1e-2}
"""|Δlogits| of a batched prefill with CPU experts against each prompt alone, where 5e-3 is too
tight. The CPU kernels round each expert input to bf16 and are batch-invariant themselves
(<= 2e-6 on the same rows); batched attention moves an input by ~1e-6 in fp32, which here
carries one element of the short prompt's 4th token across a bf16 rounding boundary before the
last MoE layer: 4.6e-3 on that MoE output (routed weights scaled by 2.5), 7.2e-3 on the logits
(0.06 % of max |logit| 11.3, the others' scale too; no expert choice changes). A matter of this
baby's weights and prompts: seeds 1 and 2 of deepseek_v3 stay within 5e-6. Tokens stay exact."""


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_prefill_equals_each_prompt_alone_cpu_experts(
    family: str, tiny_dir: Callable[..., Any]
) -> None:
    runner = LLM(tiny_dir(family), device="cpu", dtype="float32", experts="cpu",
                 progress=False).runner
    logits, tokens = greedy_together(runner)
    for prompt, got, got_tokens in zip(PROMPTS, logits, tokens, strict=True):
        want, want_tokens = greedy_alone(runner, prompt)
        assert got_tokens == want_tokens
        # bf16 expert inputs: a batch may round one differently (seen <= 1.1e-4 elsewhere)
        atol = CPU_EXPERTS_ATOL.get(family, 5e-3)
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_the_moe_runs_once_per_layer_for_all_prompts(llm_of) -> None:
    llm: LLM = llm_of("qwen3_moe")
    calls: list[int] = []  # tokens per MoE call
    hooks = [m.register_forward_hook(lambda _m, a, _o: calls.append(a[0].numel() //
                                                                   a[0].shape[-1]))
             for m in llm.model.modules() if type(m).__name__ == "HybridMoE"]
    try:
        greedy_together(llm.runner)
    finally:
        for hook in hooks:
            hook.remove()
    layers = len(hooks)
    assert calls[:layers] == [len(PROMPTS) * max(map(len, PROMPTS))] * layers  # padded rows
    assert calls[layers:] == [len(PROMPTS)] * layers * FOLLOW


def test_a_mixed_step_equals_its_prefill_and_decode_apart(llm_of) -> None:
    runner = llm_of("deepseek_v3").runner
    first, second = PROMPTS[1], PROMPTS[2]
    want_prefill, want_tokens = greedy_alone(runner, second)
    _, first_tokens = greedy_alone(runner, first)
    slots = [runner.cache.allocate() for _ in range(2)]
    try:
        token = int(runner.prefill(slots[0], first).argmax())
        plan = StepPlan((slots[0],), (token,), prefills=(PrefillChunk(slots[1], tuple(second)),))
        out = runner.step(plan)
        assert out.logits is not None and out.logits.shape == (1, runner.vocab_size)
        assert int(out.logits[0].argmax()) == first_tokens[1]
        torch.testing.assert_close(out.prefill_logits[0], want_prefill[-1:], rtol=0, atol=2e-5)
        assert runner.lengths[slots[0]] == len(first) + 1
        assert runner.lengths[slots[1]] == len(second)
        decoded = runner.decode([slots[1]], [want_tokens[0]])
        assert int(decoded[0].argmax()) == want_tokens[1]
    finally:
        for slot in slots:
            runner.free(slot)


def test_prefill_chunks_continue_a_slot_in_one_step(llm_of) -> None:
    runner = llm_of("mixtral").runner
    ids = list(range(20, 44))
    want, _ = greedy_alone(runner, ids)
    slots = [runner.cache.allocate() for _ in range(2)]
    try:
        runner.prefill(slots[0], ids[:10])
        chunks = (PrefillChunk(slots[0], tuple(ids[10:]), start=10, every_position=True),
                  PrefillChunk(slots[1], tuple(ids[:3])))
        out = runner.step(StepPlan(prefills=chunks))
        torch.testing.assert_close(out.prefill_logits[0], want[10:], rtol=0, atol=2e-5)
        torch.testing.assert_close(out.prefill_logits[1], want[2:3], rtol=0, atol=2e-5)
    finally:
        for slot in slots:
            runner.free(slot)


def test_step_plans_are_checked(llm_of) -> None:
    runner = llm_of("qwen3_moe").runner
    with pytest.raises(ValueError, match="a step needs a prefill chunk or a decode row"):
        StepPlan()
    with pytest.raises(ValueError, match="prefill needs at least one token"):
        PrefillChunk(0, ())
    with pytest.raises(ValueError, match=r"a step got a slot twice: \[1, 1\]"):
        StepPlan((1,), (5,), prefills=(PrefillChunk(1, (3,)),))
    slot = runner.cache.allocate()
    try:
        bad = StepPlan(prefills=(PrefillChunk(slot, (3, 4)), PrefillChunk(99, (3,))))
        with pytest.raises(ValueError, match=r"KV-cache slot 99 out of range \[0, 8\)"):
            runner.step(bad)
        assert runner.lengths[slot] == 0  # nothing ran: chunks are checked before the pass
    finally:
        runner.free(slot)


def chunk(n: int, start: int = 0) -> PrefillChunk:
    return PrefillChunk(0, (1,) * n, start)


def test_passes_bound_padding_and_fit_the_window() -> None:
    passes = prefill_passes([chunk(2), chunk(10), chunk(1), chunk(1)], max_len=64)
    # Longest first; a chunk joins while padded tokens stay within twice the real ones.
    assert [(p.rows, p.width) for p in passes] == [((1, 0), 10), ((2, 3), 1)]
    passes = prefill_passes([chunk(10), chunk(8), chunk(9), chunk(7)], max_len=64)
    assert [(p.rows, p.width) for p in passes] == [((0, 2, 1, 3), 10)]
    passes = prefill_passes([chunk(10), chunk(4, start=58)], max_len=64)  # 58 + 10 > 64
    assert [(p.rows, p.width) for p in passes] == [((0,), 10), ((1,), 4)]
