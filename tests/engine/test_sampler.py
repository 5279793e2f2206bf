"""Sampler: greedy, temperature, top-k, top-p, per-request seeds, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from hetmoe.engine.sampler import Sampler, SamplingParams

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
