"""Anthropic's Messages API bodies (pydantic, strict), the request turned into OpenAI-shaped chat
messages and tools (so one template path renders both), and the response's content blocks."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hetmoe.server.errors import APIError
from hetmoe.server.protocol import MAX_STOP_CHARS, MAX_TOKENS_LIMIT, ChatMessage
from hetmoe.server.tool_parsers import ParsedOutput
from hetmoe.server.tool_protocol import FunctionName, NamedToolChoice, ToolChoice, ToolDef

MAX_STOP_SEQUENCES = 16
_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    """A call the assistant made earlier."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    """A tool's answer, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else \
            "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool = False


StopSequence = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class MessagesRequest(_Strict):
    """POST /v1/messages (unknown top-level fields kept, to be named as ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: (Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)]
                     | None) = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    @property
    def ignored_fields(self) -> list[str]:
        """Top-level fields of the body this server does not know (and so ignores)."""
        return sorted(self.model_extra or {})

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as OpenAI chat messages: the system prompt first, tool results as
        `tool` turns, tool uses as the assistant's `tool_calls`."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for m in self.messages:
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": b.text()})
            if m.role == "assistant":
                out.append({"role": "assistant", "content": text, "tool_calls": calls or None})
            elif text or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": "user", "content": text})
        return [ChatMessage.model_validate(turn) for turn in out]

    def openai_tools(self) -> tuple[list[ToolDef] | None, ToolChoice | None, bool]:
        """(tools, tool_choice, parallel) in OpenAI's terms: `any` is `required`, `tool`
        names its function."""
        tools = None if self.tools is None else [
            ToolDef.model_validate({"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}})
            for t in self.tools]
        choice = self.tool_choice
        if choice is None:
            return tools, None, True
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, "field 'tool_choice.name': required when type is 'tool'",
                               "tool_choice.name")
            named = NamedToolChoice.model_validate(
                {"type": "function", "function": {"name": choice.name}})
            return tools, named, parallel
        return tools, _CHOICES[choice.type], parallel


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str, stop_sequence: str | None, calls: bool) -> str:
    """Anthropic's stop_reason of an engine finish reason."""
    if calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def content_blocks(text: str, parsed: ParsedOutput | None,
                   ids: list[str]) -> list[dict[str, Any]]:
    """The answer's content: a text block (unless empty beside calls), then its tool uses."""
    if parsed is None:
        return [{"type": "text", "text": text}]
    blocks: list[dict[str, Any]] = []
    if parsed.content.strip():
        blocks.append({"type": "text", "text": parsed.content.strip()})
    blocks += [{"type": "tool_use", "id": i, "name": c.name, "input": json.loads(c.arguments)}
               for c, i in zip(parsed.calls, ids, strict=True)]
    return blocks


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens excludes the prompt tokens read from the cache."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
