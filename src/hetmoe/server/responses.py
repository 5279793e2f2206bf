"""Response bodies of chat and text completions from a request's events: whole (every choice
gathered) or as the chunks of a stream, with log-probabilities and echo in OpenAI's shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hetmoe.engine.requests.logprobs import TokenLogprob
from hetmoe.engine.requests.request import Event
from hetmoe.server import protocol
from hetmoe.server.errors import APIError
from hetmoe.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from hetmoe.server.service import EventStream
from hetmoe.server.tool_stream import CallStart, Delta, ToolStream
from hetmoe.server.tools import ToolPlan, tool_calls_json


@dataclass
class Choice:
    """One choice's events gathered."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    last: Event | None = None

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.last = event

    @property
    def finish_reason(self) -> str:
        assert self.last is not None and self.last.finish_reason is not None
        return self.last.finish_reason


class Choices:
    """Every choice of a request (its prompts x n): events in, usage out."""

    def __init__(self, count: int, n: int) -> None:
        self.n = n
        self.all = [Choice() for _ in range(count)]

    def add(self, event: Event) -> Choice:
        """Adds an event to its choice; that choice."""
        choice = self.all[event.index]
        choice.add(event)
        return choice

    def usage(self, prompt_only: bool = False) -> protocol.Usage:
        """Prompt tokens once per prompt, completion tokens of every choice (none when the
        generated token is dropped: `prompt_only`)."""
        lasts = [c.last for c in self.all]
        firsts = lasts[:: self.n]  # one choice per prompt
        return protocol.usage(
            sum(e.prompt_tokens for e in firsts if e is not None),
            0 if prompt_only else sum(e.completion_tokens for e in lasts if e is not None),
            sum(e.cached_tokens for e in firsts if e is not None),
        )


def chat_body(rid: str, model: str, choices: Choices, logprobs: bool,
              text: TokenText, plan: ToolPlan | None = None) -> dict[str, Any]:
    """The chat.completion object of a finished request (its answers' tool calls parsed when
    the request offered tools)."""
    out = []
    for i, c in enumerate(choices.all):
        answer: str | None = "".join(c.text)
        finish, calls = c.finish_reason, None
        parsed = plan.parse(answer) if plan is not None and answer else None
        if plan is not None and parsed is not None:
            answer = parsed.content.strip() or None
            calls = tool_calls_json(parsed.calls, plan.ids(len(parsed.calls)))
            finish = "tool_calls"
        elif plan is not None and plan.choice != "auto":
            raise plan.missing_call(answer or "")
        out.append(protocol.chat_choice(i, answer, finish,
                                        chat_logprobs(c.logprobs, text) if logprobs else None,
                                        calls))
    return protocol.chat_response(rid, model, out, choices.usage())


def completion_body(rid: str, model: str, choices: Choices, logprobs: bool,
                    echo: Sequence[tuple[str, list[int]]] | None, text: TokenText,
                    prompt_only: bool = False) -> dict[str, Any]:
    """The text_completion object of a finished request; `echo`: each prompt's (text, ids);
    `prompt_only` (max_tokens 0): the generated token dropped, finish_reason `length`."""
    out = []
    for i, c in enumerate(choices.all):
        prefix, ids, scored = "", list[int](), list[TokenLogprob | None]()
        if echo is not None:
            prefix, ids = echo[i // choices.n]
            scored = list(c.prompt_logprobs or [None] * len(ids))
        answer, tokens, entries = ("", [], []) if prompt_only else (
            "".join(c.text), c.token_ids, c.logprobs)
        shown = None
        if logprobs:
            shown = completion_logprobs([*scored, *entries], ids + tokens, text)
        finish = "length" if prompt_only else c.finish_reason
        out.append(protocol.completion_choice(i, prefix + answer, finish, shown))
    return protocol.completion_object(rid, model, out, choices.usage(prompt_only))


def _delta(piece: Delta) -> dict[str, Any]:
    """A chat chunk's delta as OpenAI streams calls: a call's first delta has its index, id,
    type, name and empty arguments; the next ones pieces of its arguments."""
    if isinstance(piece, str):
        return {"content": piece}
    if isinstance(piece, CallStart):
        return {"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}


def _error_body(error: APIError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": "invalid_request_error",
                      "param": error.param, "code": error.status}}


def _stream_error(event: Event) -> dict[str, Any]:
    status = 500 if event.finish_reason == "error" else 503
    message = f"generation failed: {event.error}" if status == 500 else "server shutting down"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": status}}


async def chat_chunks(rid: str, body: protocol.ChatCompletionRequest, stream: EventStream,
                      observe: Callable[[Event], None], text: TokenText,
                      count: int, plan: ToolPlan | None = None) -> AsyncIterator[dict[str, Any]]:
    """A chat stream: each choice's role chunk, its content (and logprobs) chunks, its tool
    calls (when the request offered tools), its finish chunk; the usage chunk last when asked
    for."""
    choices = Choices(count, body.n)
    calls = [ToolStream(plan) for _ in range(count)] if plan is not None else None
    for index in range(count):
        yield protocol.chat_chunk(rid, body.model, {"role": "assistant", "content": ""},
                                  index=index)
    async for event in stream:
        observe(event)
        choices.add(event)
        if event.finish_reason in ("error", "cancelled"):
            yield _stream_error(event)
            return
        shown = chat_logprobs(event.logprobs, text) if body.logprobs and event.logprobs else None
        pieces: list[Delta] = (calls[event.index].feed(event.text) if calls is not None
                               else [event.text] if event.text else [])
        if shown is not None and not pieces:
            pieces = [""]
        for piece in pieces:  # the event's logprobs go with its first delta
            yield protocol.chat_chunk(rid, body.model, _delta(piece), index=event.index,
                                      logprobs=shown)
            shown = None
        if event.finish_reason is None:
            continue
        finish = event.finish_reason
        if calls is not None:
            tool_stream = calls[event.index]
            rest, parsed = tool_stream.finish()
            for piece in rest:
                yield protocol.chat_chunk(rid, body.model, _delta(piece), index=event.index)
            if parsed is None and tool_stream.plan.choice != "auto":
                yield _error_body(tool_stream.plan.missing_call(tool_stream.text))
                return
            if parsed is not None:
                finish = "tool_calls"
        yield protocol.chat_chunk(rid, body.model, {}, finish, index=event.index)
    if body.include_usage:
        yield protocol.chat_chunk(rid, body.model, {}, use=choices.usage(), with_choice=False)


async def completion_chunks(rid: str, body: protocol.CompletionRequest, stream: EventStream,
                            observe: Callable[[Event], None], text: TokenText, count: int,
                            echo: Sequence[tuple[str, list[int]]] | None,
                            prompt_only: bool = False) -> AsyncIterator[dict[str, Any]]:
    """A completions stream: an echoed prompt first (with its logprobs), then each event's text
    and logprobs (none with `prompt_only`), each choice's finish chunk; the usage chunk last
    when asked for."""
    choices = Choices(count, body.n)
    offsets = [0] * count  # characters shown so far per choice (text_offset)
    logprobs = body.logprobs is not None

    def chunk(index: int, piece: str, finish: str | None,
              entries: Sequence[TokenLogprob | None], ids: list[int]) -> dict[str, Any]:
        shown = None
        if logprobs and ids:
            shown = completion_logprobs(entries, ids, text, offsets[index])
            offsets[index] += sum(len(text(t)[0]) for t in ids)
        return protocol.completion_object(
            rid, body.model, [protocol.completion_choice(index, piece, finish, shown)])

    async for event in stream:
        observe(event)
        first = choices.all[event.index].last is None
        choices.add(event)
        if event.finish_reason in ("error", "cancelled"):
            yield _stream_error(event)
            return
        if first and echo is not None:
            prompt, ids = echo[event.index // body.n]
            scored = list(event.prompt_logprobs or [None] * len(ids))
            yield chunk(event.index, prompt, None, scored, ids)
        if not prompt_only and (event.text or (logprobs and event.token_ids)):
            yield chunk(event.index, event.text, None, event.logprobs, list(event.token_ids))
        if event.finish_reason is not None:
            yield chunk(event.index, "", "length" if prompt_only else event.finish_reason, [], [])
    if body.include_usage:
        yield protocol.completion_object(rid, body.model, [], choices.usage(prompt_only))
