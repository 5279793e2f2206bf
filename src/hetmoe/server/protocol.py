"""OpenAI-compatible request and response bodies (pydantic), validated strictly.

Strict mode: a JSON string where a number is expected is a 400, not a silent coercion. Unknown
top-level fields are accepted and named as ignored (clients send many extensions; as vLLM does:
a log warning and the `x-hetmoe-ignored-fields` header), known-but-unsupported ones are refused
by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from hetmoe.server.tool_protocol import ResponseFormat, ToolCallIn, ToolChoice, ToolDef

# Hard ceilings that catch absurd values before they reach the engine's own context check.
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_STRINGS = 16
"""OpenAI takes 4; evaluators send more (lm-eval's code tasks: 5 and the EOS text)."""
MAX_STOP_CHARS = 256
SEED_LIMIT = (1 << 63) - 1
MAX_CHOICES = 128
"""`n` at most (the engine's KV slots are the tighter limit, checked per server)."""
MAX_PROMPTS = 256
"""Prompts of one completions request at most."""
MAX_CHAT_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOOLS = 128


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Request):
    """One part of a multi-part message content; only text is supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """A chat turn as OpenAI clients send it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    """An assistant turn's calls."""
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """The call a tool turn answers."""
    name: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The message text, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="allow")  # kept, to be named as ignored

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS_LIMIT)] | None = None
    seed: Annotated[int, Field(ge=-SEED_LIMIT, le=SEED_LIMIT)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    """Extension (as in vLLM): > 1 discourages tokens of the prompt and the output."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Extension (as in vLLM)."""
    ignore_eos: bool = False
    """Extension (as in vLLM): generate exactly the token budget; for benchmarks."""
    response_format: ResponseFormat | None = None
    """JSON by constrained decoding (engine/requests/constrained.py), on chat and text
    completions."""

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for stop in stops:
            if not stop or len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return stops

    @property
    def stops(self) -> list[str]:
        """Stop strings as a list (the validator normalized a single string)."""
        return list(self.stop or [])

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields of the body this server does not know (and so ignores)."""
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most the first call of an answer is returned."""
    functions: list[Any] | None = None
    """Deprecated by OpenAI for `tools`; refused by name."""
    function_call: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def token_logprobs(self) -> int | None:
        """Alternatives per generated token (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_logprobs(self) -> int | None:
        """Chat never scores the prompt."""
        return None

    @property
    def token_budget(self) -> int | None:
        """The newer `max_completion_tokens` wins over the deprecated `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    """One prompt (text or token ids) or several (choice index = prompt index x n + i)."""
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    """0 only with `echo`: the prompt and its logprobs, nothing generated (lm-eval, vLLM)."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list (one or several)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return prompt  # type: ignore[return-value]

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs(self) -> int | None:
        """Echo with logprobs scores the prompt from the prefill's logits."""
        return self.logprobs if self.echo else None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """The usage block of a response (`cached_tokens`: prompt tokens the prefix cache held)."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def new_id(prefix: str) -> str:
    """An OpenAI-style object id (`chatcmpl-…`, `cmpl-…`)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_choice(index: int, text: str | None, finish_reason: str,
                logprobs: dict[str, Any] | None,
                tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a chat.completion (with `tool_calls` when the answer made calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish_reason,
            "logprobs": logprobs}


def chat_response(rid: str, model: str, choices: list[dict[str, Any]],
                  use: Usage) -> dict[str, Any]:
    """A complete (non-streamed) chat.completion object."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use.model_dump()}


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    use: Usage | None = None,
    with_choice: bool = True,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One chat.completion.chunk of a stream; the usage chunk has no choices."""
    choices = [{"index": index, "delta": delta, "finish_reason": finish_reason,
                "logprobs": logprobs}] if with_choice else []
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                             "created": int(time.time()), "model": model, "choices": choices}
    if use is not None or not with_choice:
        chunk["usage"] = use.model_dump() if use is not None else None
    return chunk


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a text_completion (or of one of its chunks)."""
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_object(rid: str, model: str, choices: list[dict[str, Any]],
                      use: Usage | None = None) -> dict[str, Any]:
    """A text_completion object: the whole answer, or one chunk of a stream (no choices: the
    usage chunk)."""
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use.model_dump()
    return body


def model_card(name: str, created: int) -> dict[str, Any]:
    """One entry of GET /v1/models."""
    return {"id": name, "object": "model", "created": created, "owned_by": "hetmoe"}
