"""A request's sampling: fields it leaves out take the model's generation_config.json, else the
API's defaults (temperature 1, no top-p / top-k / min-p cut, no penalties)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hetmoe.engine.requests.constrained import ResponseFormat
from hetmoe.engine.requests.sampler import SamplingParams

GREEDY_BELOW = 1e-4
"""Temperatures below this are greedy, the limit of sampling as T -> 0 (dividing logits by a
denormal temperature would overflow)."""


def request_sampling(
    model: Mapping[str, Any],
    max_tokens: int,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: Sequence[str] = (),
    seed: int | None = None,
    min_p: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    adapter: str | None = None,
    response_format: ResponseFormat | None = None,
) -> SamplingParams:
    """`SamplingParams` of a request's fields; None takes `model`'s default (the checkpoint's
    generation_config.json, `LLM.sampling_defaults`), else the API's. `adapter`: the LoRA
    adapter the request named as its model (None: the base model); `response_format`: JSON
    the answer must be (None: free text)."""

    def pick(value: float | None, name: str, default: float) -> float:
        return float(value if value is not None else model.get(name, default))

    top_k = top_k if top_k is not None else int(model.get("top_k", 0))
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_temperature(temperature if temperature is not None
                                 else model.get("temperature")),
        top_p=pick(top_p, "top_p", 1.0),
        top_k=max(top_k, 0),
        seed=seed,
        stop=tuple(stop),
        min_p=pick(min_p, "min_p", 0.0),
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=pick(repetition_penalty, "repetition_penalty", 1.0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        adapter=adapter,
        response_format=response_format,
    )


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    return 0.0 if value < GREEDY_BELOW else value
