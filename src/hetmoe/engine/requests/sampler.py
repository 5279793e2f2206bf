"""Sampling: per-request parameters, the token sampler, and what a generation returns.

A request's logits go through, in order: its `response_format`'s mask
(engine/requests/constrained.py: tokens that would leave the format at -inf, on the logits' device),
repetition / frequency / presence penalties (over the tokens seen so far), temperature (0 or top_k
1: the argmax of the penalized logits), top_k, min_p, top_p, then one draw from the request's own
seeded generator.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetmoe.engine.requests.constrained import JsonConstraint, ResponseFormat
from hetmoe.engine.requests.logprobs import TokenLogprob

MAX_LOGPROBS = 20
"""Alternatives per position that `logprobs` / `prompt_logprobs` may ask for at most."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, when it stops, and what it reports."""

    max_new_tokens: int = 128
    """Tokens to generate at most (the context window may stop it sooner)."""
    temperature: float = 0.0
    """0 is greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus: keep the most likely tokens whose mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 keeps all)."""
    seed: int | None = None
    """Seed of the request's own generator; None draws a fresh one."""
    stop: tuple[str, ...] = ()
    """Strings that end the text (not included in it)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the most likely token's (0 keeps all)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated at least once (OpenAI's, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI's, -2..2)."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or the output
    (HF / vLLM's; 1 is off)."""
    logprobs: int | None = None
    """Report each generated token's log-probability and its `logprobs` most likely
    alternatives (0: the token's own only; None: none)."""
    prompt_logprobs: int | None = None
    """Report the prompt tokens' log-probabilities (the first has none) and their
    `prompt_logprobs` most likely alternatives, from the prefill's logits."""
    adapter: str | None = None
    """The LoRA adapter (its name in `LLM(lora=...)`) that generates; None: the base model."""
    response_format: ResponseFormat | None = None
    """What the answer must be: JSON (`ResponseFormat`, or OpenAI's dict such as
    {"type": "json_object"}); None: free text."""

    def __post_init__(self) -> None:
        if not isinstance(self.response_format, ResponseFormat | None):
            object.__setattr__(self, "response_format", ResponseFormat.of(self.response_format))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of a request with several: seed + index."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + index)


_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(**sampling: Any) -> SamplingParams:
    """`SamplingParams` from keywords (`LLM.generate`'s, the CLI's): one stop string or several;
    an unknown keyword is a TypeError naming the known ones."""
    unknown = sorted(set(sampling) - _FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(_FIELDS))} (and max_tokens)")
    stop = sampling.get("stop")
    sampling["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if name in sampling:
            sampling[name] = float(sampling[name])
    return SamplingParams(**sampling)


def request_params(params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
    """`params`, or `SamplingParams` from keywords (`max_tokens` an alias of `max_new_tokens`,
    128 by default); both, or params that are not `SamplingParams`, are a TypeError."""
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (sampling options go as keywords), "
                            f"got {type(params).__name__}")
        if sampling:
            raise TypeError(f"give SamplingParams or keywords, not both (got {sorted(sampling)})")
        return params
    sampling = dict(sampling)
    sampling["max_new_tokens"] = _new_tokens(sampling.pop("max_new_tokens", None),
                                             sampling.pop("max_tokens", None))
    return sampling_params(**sampling)


def _new_tokens(max_new_tokens: int | None, max_tokens: int | None) -> int:
    """`max_new_tokens`, or its OpenAI name `max_tokens`, or 128; both given is an error."""
    if max_new_tokens is not None and max_tokens is not None:
        raise ValueError(f"give max_new_tokens or max_tokens, not both (got {max_new_tokens} "
                         f"and {max_tokens})")
    chosen = max_new_tokens if max_new_tokens is not None else max_tokens
    return 128 if chosen is None else chosen


@dataclass(frozen=True)
class GenerationOutput:
    """The result of `LLM.generate` / `LLM.chat`."""

    text: str
    """Generated text, without the prompt and without a matched stop string."""
    token_ids: list[int]
    """Generated token ids (an end-of-sequence token included when it ended generation)."""
    finish_reason: str
    """`stop` (EOS or stop string) or `length` (max_new_tokens or context window reached)."""
    prompt_tokens: int
    """Tokens in the prompt."""
    logprobs: list[TokenLogprob] | None = None
    """One per generated token, when `logprobs` was asked for."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token (None for the first), when `prompt_logprobs` was asked for."""
    cached_tokens: int = dataclasses.field(default=0, compare=False)
    """Prompt tokens whose KV the prefix cache held (not prefilled again; not compared: the
    same output comes with or without the cache)."""


class Sampler:
    """Draws tokens for one request from its own seeded CPU generator (reproducible anywhere)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 constraint: JsonConstraint | None = None) -> None:
        """`constraint`: the request's walk over its `response_format` (masks every draw)."""
        self.params = params
        self.constraint = constraint
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self._prompt = sorted(set(prompt_ids)) if params.repetition_penalty != 1.0 else []
        self._counts: Counter[int] = Counter()  # generated tokens, kept when penalized

    @property
    def greedy(self) -> bool:
        """Whether every token is the argmax of the (penalized) logits."""
        return self.params.temperature == 0.0 or self.params.top_k == 1

    @property
    def needs_logits(self) -> bool:
        """Whether this request needs its logits each step: sampled, penalized, constrained or
        reporting log-probabilities (else the runner's argmax is its token)."""
        p = self.params
        return (not self.greedy or p.penalized or p.logprobs is not None
                or self.constraint is not None)

    def observe(self, token: int) -> None:
        """Takes a token the request generated: the constraint's next state, the penalties'
        counts."""
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.params.penalized:
            self._counts[token] += 1

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] (float32, on the CPU) with the penalties applied to the tokens seen."""
        p = self.params
        if not p.penalized:
            return logits
        logits = logits.clone()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self._prompt) | set(self._counts)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                       values * p.repetition_penalty)
        if self._counts and (p.frequency_penalty or p.presence_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=logits.dtype)
            logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return logits

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from logits [V]."""
        p = self.params
        if self.constraint is not None:
            logits = self.constraint.apply(logits)
        if self.greedy and not p.penalized:
            return int(torch.argmax(logits))
        logits = self.penalize(logits.float().cpu())  # [V]
        if self.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [V]
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            probs = probs / probs.sum()
            sorted_probs, order = torch.sort(probs, descending=True)
            # Drop tokens whose preceding mass already reaches top_p; the first always stays.
            sorted_probs[torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
