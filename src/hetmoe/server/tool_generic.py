"""Tools for chat templates that render none (as llama.cpp's server does for them): the tools and
the call syntax are added to the system message. A template that still writes a known call
format (DeepSeek-V3.1's renders calls but not tools) keeps that syntax; any other gets the
generic format: each call one line of JSON, `{"tool_call": {"name": NAME, "arguments": {...}}}`,
and the history's calls and tool results written into the turns' text in the same JSON (a
tool's result as a user turn `{"tool_response": {"name", "content"}}`: such templates know no
`tool` role). Forced generic calls are ordinary text, constrained by tool_grammar.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from hetmoe.server.tool_grammar import generic_forced
from hetmoe.server.tool_parsers import ToolFormat, detect, json_prefix, named_call

START = '{"tool_call"'
_HEADER = re.compile(r'\{"tool_call"\s*:\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*\}")

INSTRUCTION = (
    "You can call these tools (JSON Schema function definitions):\n{tools}\n\n"
    "To call a tool, answer with the call alone, in this form (one a line for several):\n"
    "{syntax}\nEach call's result comes back to you. Otherwise answer in plain text."
)
"""What the system message gains: the tools (one JSON definition a line) and the call syntax."""


def _call(text: str) -> tuple[tuple[str, object], str] | None:
    """The call at the start of `text` ((name, arguments as written), the text after it)."""
    header = _HEADER.match(text)
    if header is not None:
        try:
            _, end = json.JSONDecoder().raw_decode(text, header.end())
        except json.JSONDecodeError:
            return None
        tail = _TAIL.match(text, end)
        if tail is not None:
            return (header.group(1), text[header.end():end]), text[tail.end():]
    found = json_prefix(text)  # other spacing or key order
    if found is None or not isinstance(found[0], dict) or set(found[0]) != {"tool_call"}:
        return None
    call = named_call(found[0]["tool_call"])
    return (call, found[1]) if call is not None else None


def _split(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    """Calls one after another from the start of `text`; what follows them is content."""
    calls: list[tuple[str, object]] = []
    rest = text
    while rest.startswith(START):
        found = _call(rest)
        if found is None:
            return None
        calls.append(found[0])
        rest = found[1].lstrip()
    return rest.strip(), calls


GENERIC = ToolFormat("generic", START, (), _split, header=_HEADER, tail=_TAIL,
                     grammar=generic_forced,
                     syntax='{"tool_call": {"name": "<function name>", "arguments": '
                            '{<its arguments>}}}')
"""The format of a template that renders no tools and writes no known call format."""


def renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the `tools` it is given."""
    return bool(template) and "tools" in str(template)


def template_format(template: str | None) -> tuple[ToolFormat | None, bool]:
    """(the call format of a chat template, whether its tools go into the system message);
    None: the template renders tools in a format no parser knows."""
    form = detect(template or "")
    if renders_tools(template):
        return form, False
    return form or GENERIC, True


def with_tool_prompt(turns: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]],
                     form: ToolFormat) -> list[dict[str, Any]]:
    """`turns` with the tools and `form`'s call syntax in the system message (a new first turn
    when there is none)."""
    out = list(turns)
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    prompt = INSTRUCTION.format(tools=listed, syntax=form.syntax)
    if out and out[0]["role"] == "system":
        first = out[0]["content"]
        out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def generic_turns(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`turns` (as `tools.template_messages` gives them) with calls and tool results written
    as the generic format's JSON text."""
    names: dict[str, str] = {}  # call id -> function name, for the tool results
    out: list[dict[str, Any]] = []
    for given in turns:
        turn = {k: v for k, v in given.items() if k not in ("tool_calls", "tool_call_id")}
        calls = given.get("tool_calls") or []
        if calls:
            lines = [json.dumps({"tool_call": {"name": c["function"]["name"],
                                               "arguments": c["function"]["arguments"]}},
                                ensure_ascii=False) for c in calls]
            names.update({c["id"]: c["function"]["name"] for c in calls})
            turn["content"] = "\n".join([turn["content"], *lines] if turn["content"] else lines)
        if turn["role"] == "tool":
            name = turn.pop("name", None) or names.get(given.get("tool_call_id", ""))
            result = {"name": name, "content": turn["content"]}
            turn = {"role": "user", "content": json.dumps({"tool_response": result},
                                                          ensure_ascii=False)}
        out.append(turn)
    return out
