"""Regular expressions of forced tool calls (`tool_choice` `required` or a named function): the
call syntax of the chat template's format around `{"name": <an allowed name>, "arguments": ...}`,
the arguments constrained to the function's `parameters` JSON schema (outlines-core's regex of
the schema, as `response_format` uses; no schema or a free-form object: any JSON object).

Only formats whose call syntax is ordinary text get one: Qwen / Hermes `<tool_call>` blocks.
Mistral's `[TOOL_CALLS]` and DeepSeek's tool-call tokens are special tokens, which constrained
decoding leaves out of its vocabulary (they stand for no text), so their forced calls are not
constrained (a reply without the call is still a 422).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from hetmoe.engine.constrained import ResponseFormat

_META = set("\\.+*?()|[]{}^$#&-~")
"""Characters that mean something in outlines-core's (Rust) regex syntax. `<` and `>` stay
bare: escaped, they are word boundaries there."""

Grammar = Callable[[Sequence[tuple[str, str]], bool], str]
"""[(function name, regex of its arguments)], parallel calls allowed -> regex of the reply."""


def literal(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    out = []
    for char in text:
        if char == "\n":
            out.append(r"\n")
        elif char in _META:
            out.append("\\" + char)
        else:
            out.append(char)
    return "".join(out)


def arguments_regex(parameters: dict[str, Any] | None, name: str) -> str:
    """The regex of a call's arguments: a JSON object that matches `parameters` (any object
    when there is no schema). ValueError naming the function when outlines-core cannot follow
    the schema."""
    schema = parameters if parameters else {"type": "object"}
    fmt = ResponseFormat("json_schema", json.dumps(schema), name)
    try:
        return fmt.regex()
    except ValueError as exc:
        message = str(exc).removeprefix(f"response_format: {fmt.label}: ")
        raise ValueError(f"the parameters of {name!r}: {message}") from None


def qwen_calls(functions: Sequence[tuple[str, str]], parallel: bool) -> str:
    """Qwen / Hermes: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, as the
    template writes a call, one or more (joined by a newline) when `parallel`."""
    bodies = "|".join(literal(f'{{"name": "{name}", "arguments": ') + f"({arguments})" + r"\}"
                      for name, arguments in functions)
    call = literal("<tool_call>\n") + f"({bodies})" + literal("\n</tool_call>")
    return f"{call}(\\n{call})*" if parallel else call


def forced_calls(grammar: Grammar, tools: Sequence[dict[str, Any]], parallel: bool,
                 label: str) -> ResponseFormat:
    """The `regex` format of a reply that is only calls of `tools` (transformers' tool dicts),
    through `grammar`; ValueError naming the function whose schema cannot be followed."""
    functions = [(tool["function"]["name"],
                  arguments_regex(tool["function"].get("parameters"), tool["function"]["name"]))
                 for tool in tools]
    return ResponseFormat("regex", name=label, pattern=grammar(functions, parallel))
