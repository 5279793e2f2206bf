"""`CollectedOutput`: one request's events (text pieces, tokens, log-probabilities, the final
event) gathered into the `GenerationOutput` that `LLM.generate` / `chat` return."""

from __future__ import annotations

from collections.abc import Callable

from hetmoe.engine.requests.logprobs import TokenLogprob
from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import GenerationOutput, SamplingParams


class CollectedOutput:
    """One request's events gathered into its `GenerationOutput`."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.last: Event | None = None

        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        self.tokens.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = list(event.prompt_logprobs)
        if event.finish_reason is not None:
            self.last = event

    def output(self, params: SamplingParams,
               named: Callable[[TokenLogprob], TokenLogprob]) -> GenerationOutput:
        """The output; `named` adds the text of a logprobs entry's tokens."""
        last = self.last
        assert last is not None and last.finish_reason is not None
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        logprobs = [named(e) for e in self.logprobs] if params.logprobs is not None else None
        prompt = self.prompt_logprobs
        if prompt is not None:
            prompt = [None if e is None else named(e) for e in prompt]
        return GenerationOutput("".join(self.text), self.tokens, last.finish_reason,
                                len(self.prompt), logprobs, prompt, last.cached_tokens)

