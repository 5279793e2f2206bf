"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch
from sampling_reference import penalized_reference

from hetmoe.engine.requests.sampler import Sampler, SamplingParams, sampling_params

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def draws(params: SamplingParams, n: int = 2000) -> torch.Tensor:
    sampler = Sampler(params)
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sampler(LOGITS)] += 1
    return counts / n


def test_greedy_and_degenerate_settings_pick_the_argmax() -> None:
    assert Sampler(SamplingParams())(LOGITS) == 0
    assert Sampler(SamplingParams(temperature=1.0, top_k=1))(LOGITS) == 0
    assert draws(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), 50)[0] == 1.0


def test_temperature_one_follows_the_distribution() -> None:
    freq = draws(SamplingParams(temperature=1.0, seed=0))
    torch.testing.assert_close(freq, LOGITS.exp(), rtol=0, atol=0.04)


def test_top_k_and_top_p_cut_the_tail() -> None:
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=1))[2:].sum() == 0
    # top_p=0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it -> only tokens 0 and 1 remain.
    freq = draws(SamplingParams(temperature=1.0, top_p=0.7, seed=2))
    assert freq[2:].sum() == 0 and math.isclose(float(freq[0]), 0.5 / 0.8, abs_tol=0.04)


def test_seeds_reproduce_per_request() -> None:
    params = SamplingParams(temperature=2.0, seed=123)
    a, b = Sampler(params), Sampler(params)
    assert [a(LOGITS) for _ in range(30)] == [b(LOGITS) for _ in range(30)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"stop": ("",)}, r"stop must be non-empty strings, got \[''\]"),
    ],
)
def test_bad_parameters_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8), (1.5, -1.0, 2.0)],
)
def test_penalties_equal_a_float64_reference(presence: float, frequency: float,
                                             repetition: float) -> None:
    logits = torch.tensor([1.5, -0.5, 0.25, -2.0, 3.0, 0.0, 0.75, -1.25])
    prompt, output = [1, 2, 2], [4, 4, 4, 6, 1]
    sampler = Sampler(SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                                     repetition_penalty=repetition), prompt)
    for token in output:
        sampler.observe(token)
    want = penalized_reference(logits.tolist(), prompt, output, presence, frequency, repetition)
    torch.testing.assert_close(sampler.penalize(logits).double(), want, rtol=0, atol=1e-6)
    assert sampler(logits) == int(want.argmax())  # greedy takes the penalized argmax


def test_penalties_change_greedy_output_and_need_logits() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    plain = Sampler(SamplingParams())
    assert not plain.needs_logits and plain(logits) == 0
    sampler = Sampler(SamplingParams(frequency_penalty=0.2))
    assert sampler.needs_logits
    picks = []
    for _ in range(4):
        picks.append(sampler(logits))
        sampler.observe(picks[-1])
    # 2.0 - 0.2 = 1.8 < 1.9: token 1 next, then 1.9 - 0.2 = 1.7 < 1.8: token 0 again ...
    assert picks == [0, 1, 0, 1]
    assert Sampler(SamplingParams(logprobs=0)).needs_logits


def test_penalties_shift_the_sampled_distribution() -> None:
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, seed=3)
    sampler = Sampler(params)
    sampler.observe(0)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[sampler(LOGITS)] += 1
    want = torch.softmax(LOGITS - torch.tensor([1.0, 0.0, 0.0, 0.0]), dim=-1)
    torch.testing.assert_close(counts / 3000, want, rtol=0, atol=0.03)


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    # Top probability 0.5: min_p 0.4 keeps tokens >= 0.2 (0.5 and 0.3), renormalized.
    freq = draws(SamplingParams(temperature=1.0, min_p=0.4, seed=4), 3000)
    assert freq[2:].sum() == 0
    assert math.isclose(float(freq[0]), 0.5 / 0.8, abs_tol=0.03)
    assert draws(SamplingParams(temperature=1.0, min_p=1.0, seed=5), 50)[0] == 1.0


def test_choices_take_consecutive_seeds() -> None:
    params = SamplingParams(temperature=1.0, seed=10)
    assert [params.for_choice(i).seed for i in range(3)] == [10, 11, 12]
    assert SamplingParams(temperature=1.0).for_choice(2).seed is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\], got 21"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be None or in \[0, 20\], got -1"),
    ],
)
def test_bad_new_parameters_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_keyword_is_named() -> None:
    with pytest.raises(TypeError, match="unknown sampling option.s. top_q; known: .*min_p"):
        sampling_params(top_q=0.5)
