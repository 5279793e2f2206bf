"""Expert-aware pre-placement (engine/preplacement.py): a job's sampled prompts, the routing
counts of prefilling them against what the experts were given, and the plan that places each
layer's most routed experts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe.engine.placement.placement_plan import plan_placement
from hetmoe.engine.placement.slots import expert_bytes
from hetmoe.engine.preplacement import count_routing, line_prompt, preplace, sample_lines
from hetmoe.engine.requests.batch_job import JobLine
from hetmoe.ops.moe import moe_layers

PROMPTS = [list(range(10, 30)), list(range(50, 57)), [3, 4, 5, 6, 7, 8, 9, 11, 200, 201]]


def completion(number: int, prompt: Any) -> JobLine:
    return JobLine(number, f"id-{number}", "/v1/completions", {"prompt": prompt})


def test_the_sample_is_evenly_spaced_over_the_lines() -> None:
    lines = [completion(n, "x") for n in range(1, 11)]
    assert [line.number for line in sample_lines(lines, 4)] == [1, 3, 6, 8]
    assert [line.number for line in sample_lines(lines, 30)] == list(range(1, 11))
    assert sample_lines(lines, 0) == []
    with pytest.raises(ValueError, match="the placement sample must be >= 0 prompts, got -1"):
        sample_lines(lines, -1)


def test_a_line_prompt_is_what_the_api_renders(llm_of: Callable[[str], LLM]) -> None:
    llm = llm_of("qwen3_moe")
    messages = [{"role": "user", "content": "Hello there"}]
    chat = JobLine(1, "c", "/v1/chat/completions", {"messages": messages})
    assert line_prompt(llm, chat) == llm.chat_prompt(messages)
    parts = JobLine(2, "p", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                     {"type": "text", "text": "there"}]}]})
    assert line_prompt(llm, parts) == llm.chat_prompt(messages)
    assert line_prompt(llm, completion(3, "Once upon")) == llm.encode("Once upon")
    assert line_prompt(llm, completion(4, [5, 6, 7])) == [5, 6, 7]
    assert line_prompt(llm, completion(5, ["Once upon", "a time"])) == llm.encode("Once upon")
    with pytest.raises(ValueError, match="line 6: 'prompt' must be a string or token ids"):
        line_prompt(llm, completion(6, None))
    with pytest.raises(ValueError, match="line 7: 'messages' must be a non-empty list"):
        line_prompt(llm, JobLine(7, "m", "/v1/chat/completions", {"messages": []}))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_routing_counts_are_the_ids_the_experts_were_given(
        family: str, llm_of: Callable[[str], LLM]) -> None:
    runner = llm_of(family).runner
    layers = moe_layers(runner.model)
    given: list[list[torch.Tensor]] = [[] for _ in layers]
    originals = [m.experts.submit for m in layers]

    def recording(i: int, submit: Any) -> Any:
        def record(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
            given[i].append(ids.reshape(-1).clone())
            return submit(x, ids, weights)
        return record

    for i, moe in enumerate(layers):
        moe.experts.submit = recording(i, originals[i])
    try:
        counts = count_routing(runner, PROMPTS, chunk=6)  # prompts continue across steps
    finally:
        for moe in layers:
            del moe.experts.submit  # the instance attribute: the class's method again
    top_k = layers[0].gate.config.top_k
    for i, moe in enumerate(layers):
        experts = moe.experts.spec.num_experts
        want = torch.bincount(torch.cat(given[i]), minlength=experts)
        assert torch.equal(counts[i], want), f"MoE layer {i}"
        assert int(counts[i].sum()) == sum(map(len, PROMPTS)) * top_k
    assert torch.equal(torch.stack(count_routing(runner, PROMPTS)), torch.stack(counts))
    assert len(runner.cache.free_slots) == runner.max_batch  # its slot given back
    with pytest.raises(ValueError, match="count_routing: chunk must be >= 1 token, got 0"):
        count_routing(runner, PROMPTS, chunk=0)


def test_preplace_puts_the_sample_s_most_routed_experts_on_the_gpu(
        tiny_dir: Callable[..., Any]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
              progress=False, gpu_expert_bytes=0)  # the "GPU" is the CPU device here
    runner = llm.runner
    assert runner.overlap is not None and runner.placement is None
    lines = [completion(n, p) for n, p in enumerate(PROMPTS, start=1)]
    lines.insert(1, completion(9, None))  # sampled, no prompt: left out and named
    budget = 3 * sum(expert_bytes(runner.overlap.cpu))  # three experts per layer
    done = preplace(llm, lines, 4, budget)
    assert (done.prompts, done.tokens) == (3, sum(map(len, PROMPTS)))
    assert done.skipped == ("line 9: 'prompt' must be a string or token ids",)
    counts = list(done.counts)
    assert torch.equal(torch.stack(counts), torch.stack(count_routing(runner, PROMPTS)))
    want = plan_placement([m.num_experts for m in runner.overlap.cpu],
                          expert_bytes(runner.overlap.cpu), budget, counts)
    assert done.plan.resident == want.resident
    assert runner.placement is not None
    for i, (slots, c) in enumerate(zip(runner.placement.layers, counts, strict=True)):
        assert slots.resident == list(want.resident[i]) and len(slots.resident) == 3
        top = sorted(range(len(c)), key=lambda e: (-int(c[e]), e))[:3]
        assert sorted(slots.resident) == sorted(top), f"MoE layer {i}"
    assert done.plan.gpu_share(counts) > 3 / runner.overlap.cpu[0].num_experts
    assert done.describe().startswith("pre-placement: 3 sampled prompts (37 tokens) routed; ")
    with pytest.raises(ValueError, match="pre-placement: none of the 1 sampled lines has a "
                                         "prompt"):
        preplace(llm, [completion(5, None)], 1, budget)
