"""Log-probabilities: the step computation against float64, and `LLM.generate`'s against a full
forward (`LLM.logits`)."""

from __future__ import annotations

import pytest
import torch
from sampling_reference import penalized_reference

from hetmoe import LLM
from hetmoe.engine.requests.logprobs import prompt_logprobs, token_logprobs
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.step import StepOutput, StepPlan

PROMPT = "Hello! The harbour town woke slowly that morning."


def test_token_logprobs_equal_a_float64_log_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3  # [R, V]
    tokens, tops = [3, 49, 0, 17], [0, 5, 20, 1]
    want = torch.log_softmax(logits.double(), dim=-1)
    got = token_logprobs(logits, tokens, tops)
    for row, (entry, token, top) in enumerate(zip(got, tokens, tops, strict=True)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(want[row, token])) < 1e-5
        assert len(entry.top) == top
        values, ids = want[row].topk(top) if top else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in entry.top] == ids.tolist()
        got_values = torch.tensor([v for _, v in entry.top], dtype=torch.float64)
        torch.testing.assert_close(got_values, values.double(), rtol=0, atol=1e-5)


def test_prompt_logprobs_score_each_token_by_the_previous_position() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    ids = [4, 9, 2, 29, 7]
    scored = prompt_logprobs(logits, ids, 2)
    want = torch.log_softmax(logits.double(), dim=-1)
    assert scored[0] is None
    for i in range(1, 5):
        entry = scored[i]
        assert entry is not None and entry.token_id == ids[i]
        assert abs(entry.logprob - float(want[i - 1, ids[i]])) < 1e-5
    with pytest.raises(ValueError, match="4 rows of logits for a prompt of 5 tokens"):
        prompt_logprobs(logits[:4], ids, 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_logprobs_equal_a_full_forward(llm_of, temperature: float) -> None:
    llm: LLM = llm_of("qwen3_moe")
    out = llm.generate(PROMPT, max_new_tokens=10, temperature=temperature, seed=5, logprobs=4,
                       prompt_logprobs=2)
    prompt = llm.encode(PROMPT)
    full = torch.log_softmax(llm.logits(prompt + out.token_ids).double(), dim=-1)  # [T, V]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for j, entry in enumerate(out.logprobs):
        row = full[len(prompt) - 1 + j]
        assert entry.token_id == out.token_ids[j]
        assert abs(entry.logprob - float(row[entry.token_id])) <= 1e-4
        assert [t for t, _ in entry.top] == row.topk(4).indices.tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert max(abs(v - float(row[t])) for t, v in entry.top) <= 1e-4
        if temperature == 0.0:  # greedy: the chosen token is the most likely
            assert entry.top[0][0] == entry.token_id
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == prompt[i]
        assert abs(entry.logprob - float(full[i - 1, prompt[i]])) <= 1e-4
        assert len(entry.top) == 2


def test_logprobs_leave_greedy_tokens_unchanged(llm_of) -> None:
    llm: LLM = llm_of("qwen3_moe")
    plain = llm.generate([PROMPT, "The baker"], max_new_tokens=12)
    scored = llm.generate([PROMPT, "The baker"], SamplingParams(max_new_tokens=12, logprobs=0))
    assert [o.token_ids for o in scored] == [o.token_ids for o in plain]
    assert all(o.logprobs is not None and all(e.top == () for e in o.logprobs) for o in scored)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)


@pytest.mark.parametrize(("presence", "frequency", "repetition"),
                         [(-2.0, 0.0, 1.0), (0.0, -1.5, 1.0), (0.0, 0.0, 0.5), (1.0, 0.5, 1.5)])
def test_penalized_greedy_tokens_are_the_penalized_argmax(
    llm_of, presence: float, frequency: float, repetition: float
) -> None:
    llm: LLM = llm_of("qwen3_moe")
    prompt = llm.encode(PROMPT)
    out = llm.generate(prompt, max_new_tokens=16, presence_penalty=presence,
                       frequency_penalty=frequency, repetition_penalty=repetition)
    full = llm.logits(prompt + out.token_ids).double()  # [T, V]
    for j, token in enumerate(out.token_ids):
        want = penalized_reference(full[len(prompt) - 1 + j].tolist(), prompt,
                                   out.token_ids[:j], presence, frequency, repetition)
        assert token == int(want.argmax()), f"token {j}"
    if presence < 0 or frequency < 0 or repetition < 1:  # rewarded repeats: the text changes
        assert out.token_ids != llm.generate(prompt, max_new_tokens=16).token_ids


def test_params_and_keywords_are_checked(llm_of) -> None:
    llm: LLM = llm_of("qwen3_moe")
    with pytest.raises(TypeError, match="give SamplingParams or keywords, not both"):
        llm.generate(PROMPT, SamplingParams(), top_k=3)
    with pytest.raises(TypeError, match="params must be a SamplingParams .* got int"):
        llm.generate(PROMPT, 8)  # type: ignore[call-overload]


def test_only_requests_that_need_logits_leave_the_greedy_fast_path(
    llm_of, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm: LLM = llm_of("qwen3_moe")
    greedy_flags: list[bool] = []
    step = llm.runner.step

    def recorded(plan: StepPlan) -> StepOutput:
        if plan.slots:  # steps with decode rows (the first is the prompt's prefill alone)
            greedy_flags.append(plan.greedy)
        return step(plan)

    monkeypatch.setattr(llm.runner, "step", recorded)
    llm.generate(PROMPT, max_new_tokens=4)
    assert greedy_flags == [True] * 3  # argmax tokens only
    for asks in ({"logprobs": 0}, {"presence_penalty": 0.5}, {"temperature": 1.0}):
        greedy_flags.clear()
        llm.generate(PROMPT, max_new_tokens=4, **asks)
        assert greedy_flags == [False] * 3, asks  # logits for the sampler / log_softmax
