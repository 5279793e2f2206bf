"""A submitted request as the scheduler keeps it and what it emits (`Event`).

A request with `n` choices is n `Request`s: the first carries the others as `siblings`; they
are admitted together, share its prefill (the prompt's KV copied into their slots) and sample
with seeds seed, seed + 1, ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hetmoe.engine.requests.constrained import CompiledFormat
from hetmoe.engine.requests.logprobs import TokenLogprob
from hetmoe.engine.requests.sampler import Sampler, SamplingParams
from hetmoe.engine.requests.text_stream import CONTEXT_TOKENS, TextStream


@dataclass(frozen=True)
class Event:
    """What one choice of a request produced in one step; its last has `finish_reason` set."""

    text: str
    """New answer text since the previous event (may be empty)."""
    token_ids: tuple[int, ...]
    """Tokens sampled since the previous event."""
    prompt_tokens: int
    """Tokens in the prompt."""
    completion_tokens: int
    """Tokens this choice sampled so far, end-of-sequence included."""
    finish_reason: str | None = None
    """`stop`, `length` (max_new_tokens or a full context window), `cancelled` or `error`;
    None while generating."""
    error: str | None = None
    """What went wrong when `finish_reason == "error"`."""
    index: int = 0
    """Which of the request's `n` choices this event belongs to."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `token_ids`, when the request asked for `logprobs`."""
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """On a choice's first token event, when the request asked for `prompt_logprobs`: one per
    prompt token (None for the first)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV the prefill found cached (not computed again)."""


class QueueFull(Exception):
    """Raised by `submit` when the waiting queue is at its limit."""


@dataclass(eq=False)
class Request:
    """One choice of a submitted request, as the scheduler tracks it."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    sampler: Sampler
    text: TextStream
    ignore_eos: bool = False
    index: int = 0
    """Choice index among the request's n."""
    siblings: list[Request] = field(default_factory=list)
    """The request's other choices (on its first choice only)."""
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    cached_tokens: int = 0
    """Prompt tokens the prefill found cached."""
    filled: int = 0
    """Prompt tokens in the slot's KV cache (all of them once the prefill is done)."""

    @property
    def group(self) -> list[Request]:
        """This choice and its siblings: the requests admitted together."""
        return [self, *self.siblings]


def choices(ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
            decode_text: Callable[[list[int]], str], ignore_eos: bool, n: int,
            fmt: CompiledFormat | None = None) -> list[Request]:
    """The `n` choices of a request for prompt `ids` (the first carries the others), each
    with its own walk over the compiled response format `fmt`."""
    group = []
    for index in range(n):
        choice = params.for_choice(index)
        text = TextStream(decode_text, params.stop, ids[-CONTEXT_TOKENS:])
        sampler = Sampler(choice, ids, fmt.start() if fmt is not None else None)
        group.append(Request(ids, choice, sink, sampler, text, ignore_eos, index))
    group[0].siblings = group[1:]
    return group
