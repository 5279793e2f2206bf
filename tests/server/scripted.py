"""`ScriptedScheduler`: a test double for the model's text. It takes the server's requests like
the scheduler and answers each with a scripted text in small pieces, recording the prompt ids the
server rendered. A random baby model never writes a tool call; this one does, deterministically."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.server.service import ModelService

PIECE = 3
"""Characters per streamed event: markers and JSON arrive cut across events."""


class _Handle:
    def cancel(self) -> None:
        """Every event was already delivered."""


class ScriptedScheduler:
    """Answers every request (each of its n choices) with the next scripted text."""

    def __init__(self, answers: Sequence[str], finish_reason: str = "stop") -> None:
        self._answers = list(answers)
        self.finish_reason = finish_reason
        self.prompts: list[list[int]] = []
        """The prompt ids of each request, in order."""

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Event], None], ignore_eos: bool = False,
               n: int = 1) -> _Handle:
        self.prompts.append(list(prompt_ids))
        text = self._answers.pop(0)
        pieces = [text[i:i + PIECE] for i in range(0, len(text), PIECE)]
        for index in range(n):
            for count, piece in enumerate(pieces, 1):
                last = count == len(pieces)
                sink(Event(piece, (count,), len(prompt_ids), count,
                           self.finish_reason if last else None, index=index))
        return _Handle()


@contextmanager
def scripted(service: ModelService, *answers: str,
             finish_reason: str = "stop") -> Iterator[ScriptedScheduler]:
    """Within the block, `service` answers with `answers` (one per request) instead of its
    model."""
    real = service.scheduler
    double = ScriptedScheduler(answers, finish_reason)
    service.scheduler = double  # type: ignore[assignment]
    try:
        yield double
    finally:
        service.scheduler = real
