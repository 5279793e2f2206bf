"""OpenAI's tool-calling request fields (pydantic, strict): tool definitions, `tool_choice`, the
tool calls of assistant turns in the history, and `response_format`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
"""OpenAI's rule for function names: letters, digits, `_`, `.`, `-`; at most 64."""


class FunctionDef(_Strict):
    """A function the model may call: its name, what it does, its JSON Schema parameters."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDef

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' JSON-schema form)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChosenFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: FunctionName
    arguments: str
    """The arguments as JSON text, as OpenAI sends them back."""


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant turn."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CalledFunction


class ResponseFormat(_Strict):
    """`response_format`: `text`, or JSON by constrained decoding (engine/requests/constrained.py
    checks `json_schema`: {"name", "schema", "strict"})."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
