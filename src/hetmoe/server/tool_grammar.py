"""Regular expressions of forced tool calls (`tool_choice` `required` or a named function): the
call syntax of the chat template's format around `{"name": <an allowed name>, "arguments": ...}`,
the arguments constrained to the function's `parameters` JSON schema (outlines-core's regex of
the schema, as `response_format` uses; no schema or a free-form object: any JSON object).

Constrained decoding leaves special tokens out of its vocabulary (they stand for no text), so a
format whose call syntax has special tokens gets them outside the regex: the opening ones end
the prompt (`Forced.prefix`: the reply starts inside the call) and the closing ones are added to
the reply before it is parsed (`suffix`). Qwen / Hermes `<tool_call>` blocks and the generic JSON
calls are ordinary text; Mistral's `[TOOL_CALLS]` opens a JSON list of calls; DeepSeek-V3 writes
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and fenced JSON (one call: after it the reply may
only end); DeepSeek-V3.1's name comes before its separator token, so only a call of one known
function (named, or the only tool) is constrained there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hetmoe.engine.requests.constrained import ResponseFormat

_META = set("\\.+*?()|[]{}^$#&-~")
"""Characters that mean something in outlines-core's (Rust) regex syntax. `<` and `>` stay
bare: escaped, they are word boundaries there."""



@dataclass(frozen=True)
class Forced:
    """A forced reply in a format's syntax."""

    pattern: str
    """The regex of what the model writes."""
    prefix: str = ""
    """Call syntax the prompt ends with (special tokens the model cannot be made to write)."""
    suffix: str = ""
    """Closing call syntax added to the reply before it is parsed."""


@dataclass(frozen=True)
class ForcedReply:
    """A request's forced reply: its compiled-ready format and the syntax around it."""

    format: ResponseFormat
    prefix: str = ""
    suffix: str = ""


Grammar = Callable[[Sequence[tuple[str, str]], bool], Forced | None]
"""[(function name, regex of its arguments)], parallel calls allowed -> the forced reply (None:
not constrained)."""


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


def _calls(functions: Sequence[tuple[str, str]], parallel: bool, opening: str, closing: str,
           between: str) -> str:
    """`opening` + `{"name": "NAME", "arguments": ARGS` + `closing` per call, calls joined by
    `between` when `parallel`."""
    bodies = "|".join(literal(f'{{"name": "{name}", "arguments": ') + f"({arguments})"
                      for name, arguments in functions)
    call = literal(opening) + f"({bodies})" + literal(closing)
    return f"{call}({literal(between)}{call})*" if parallel else call


def qwen_calls(functions: Sequence[tuple[str, str]], parallel: bool) -> str:
    """Qwen / Hermes: `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, as the
    template writes a call, one or more (joined by a newline) when `parallel`."""
    return _calls(functions, parallel, "<tool_call>\n", "}\n</tool_call>", "\n")


def qwen_forced(functions: Sequence[tuple[str, str]], parallel: bool) -> Forced:
    return Forced(qwen_calls(functions, parallel))


def generic_forced(functions: Sequence[tuple[str, str]], parallel: bool) -> Forced:
    """The generic format: `{"tool_call": {"name": "NAME", "arguments": ARGS}}` per line."""
    return Forced(_calls(functions, parallel, '{"tool_call": ', "}}", "\n"))


def mistral_forced(functions: Sequence[tuple[str, str]], parallel: bool) -> Forced:
    """Mistral: `[TOOL_CALLS]` (in the prompt), then ` [CALL, CALL]` as its template writes."""
    calls = _calls(functions, parallel, "", "}", ", ")
    return Forced(f" ?\\[{calls}\\]", prefix="[TOOL_CALLS]")


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


def deepseek_v3_forced(functions: Sequence[tuple[str, str]], parallel: bool) -> Forced:
    """DeepSeek-V3: `NAME\\n```json\\nARGS\\n```` after `function<｜tool▁sep｜>`; one call."""
    bodies = "|".join(literal(f"{name}\n```json\n") + f"({arguments})"
                      for name, arguments in functions)
    return Forced(f"({bodies})" + literal("\n```"),
                  prefix=DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP,
                  suffix=DS_CALL_END + DS_CALLS_END)


def deepseek_v3_1_forced(functions: Sequence[tuple[str, str]], parallel: bool) -> Forced | None:
    """DeepSeek-V3.1: `NAME<｜tool▁sep｜>ARGS`; the name is written into the prompt, so only a
    call of one function is constrained (None for a choice among several)."""
    if len(functions) != 1:
        return None
    name, arguments = functions[0]
    return Forced(arguments, prefix=DS_CALLS_BEGIN + DS_CALL_BEGIN + name + DS_SEP,
                  suffix=DS_CALL_END + DS_CALLS_END)


def forced_calls(grammar: Grammar, tools: Sequence[dict[str, Any]], parallel: bool,
                 label: str) -> ForcedReply | None:
    """The `regex` format of a reply that is only calls of `tools` (transformers' tool dicts),
    through `grammar` (None: the format cannot constrain this choice); ValueError naming the
    function whose schema cannot be followed."""
    functions = [(tool["function"]["name"],
                  arguments_regex(tool["function"].get("parameters"), tool["function"]["name"]))
                 for tool in tools]
    forced = grammar(functions, parallel)
    if forced is None:
        return None
    return ForcedReply(ResponseFormat("regex", name=label, pattern=forced.pattern),
                       forced.prefix, forced.suffix)
