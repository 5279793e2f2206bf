"""Sampling: per-request parameters, the token sampler, and what a generation returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

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

    def __post_init__(self) -> None:
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


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                    seed: int | None, stop: str | Sequence[str] | None) -> SamplingParams:
    """`SamplingParams` from `LLM.generate`'s keywords (one stop string or several)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(max_new_tokens, float(temperature), float(top_p), int(top_k), seed, stops)


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


class Sampler:
    """Draws tokens for one request from its own seeded CPU generator (reproducible anywhere)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        """Whether every token is the argmax (temperature 0 or top_k 1)."""
        return self.params.temperature == 0.0 or self.params.top_k == 1

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from logits [V]."""
        p = self.params
        if self.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature  # [V]
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [V]
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Drop tokens whose preceding mass already reaches top_p; the first always stays.
            sorted_probs[torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
