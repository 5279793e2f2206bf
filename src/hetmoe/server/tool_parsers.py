"""Tool calls in a model's text, per chat-template family, found by the template's own markers.

Each `ToolFormat` knows the marker that opens its calls and parses the text from there: Qwen /
Hermes `<tool_call>{"name", "arguments"}</tool_call>` blocks, Mistral `[TOOL_CALLS]` followed by a
JSON list (or `name[ARGS]{...}` runs), DeepSeek-V3 `<｜tool▁call▁begin｜>` tokens (V3's
`function<｜tool▁sep｜>name` + fenced JSON, V3.1's `name<｜tool▁sep｜>{...}`). A call whose JSON
does not parse, whose arguments are not an object, or whose function was not offered makes the
whole output plain text: `parse` returns None. Arguments written as JSON text are returned as the
model wrote them (stripped), so streamed fragments add up to the same text; Mistral's, parsed
with their list, are written back as JSON.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass

from hetmoe.server.tool_grammar import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    Grammar,
    deepseek_v3_1_forced,
    deepseek_v3_forced,
    mistral_forced,
    qwen_forced,
)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A model output split into its text (outside the calls) and its calls."""

    content: str
    calls: tuple[ToolCall, ...]


def _openai_id() -> str:
    return "call_" + secrets.token_hex(12)


def _mistral_id() -> str:
    # Mistral's templates refuse any tool call id that is not 9 alphanumeric characters.
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes tool calls."""

    name: str
    start: str
    """The text that opens the calls; everything before it is content."""
    markers: tuple[str, ...]
    """Special tokens of the format that decoding must keep (they are the syntax)."""
    split: Callable[[str], tuple[str, list[tuple[str, object]]] | None]
    """Text from `start` on -> (content outside the calls, [(name, arguments)]), or None."""
    new_id: Callable[[], str] = _openai_id
    """A fresh tool call id in the form the family's template accepts."""
    header: re.Pattern[str] | None = None
    """From `start` to the first character of a call's arguments, the function's name its
    group 1: calls stream their arguments as they are generated (None: whole, at the end)."""
    tail: re.Pattern[str] | None = None
    """What closes a call after its arguments (with `header`)."""
    grammar: Grammar | None = None
    """The regex of forced calls (tool_grammar.py); None: forced calls are not constrained."""
    syntax: str = ""
    """One call as the model writes it, for the tool prompt of a template that renders no
    tools (tool_generic.py)."""

    def parse(self, text: str, offered: Collection[str]) -> ParsedOutput | None:
        """The calls in `text` to functions of `offered`; None when there is no call or any
        call is malformed (the caller then returns the text as it is)."""
        at = text.find(self.start)
        if at < 0:
            return None
        found = self.split(text[at:])
        if not found:
            return None
        rest, raw = found
        calls = []
        for name, arguments in raw:
            written = arguments.strip() if isinstance(arguments, str) else None
            if written is not None:
                try:
                    arguments = json.loads(written)
                except json.JSONDecodeError:
                    return None
            if not isinstance(name, str) or name not in offered or not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(name, written or json.dumps(arguments, ensure_ascii=False)))
        return ParsedOutput(text[:at] + rest, tuple(calls)) if calls else None


def json_prefix(text: str) -> tuple[object, str] | None:
    """The JSON value at the start of `text` (after blanks) and what follows it."""
    text = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return value, text[end:]


def named_call(value: object) -> tuple[str, object] | None:
    """(name, arguments) of a call object `{"name", "arguments" (or "parameters")}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return value["name"], value.get("arguments", value.get("parameters", {}))


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_QWEN_HEADER = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_QWEN_TAIL = re.compile(r"\s*\}\s*</tool_call>")


def _split_qwen(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    calls: list[tuple[str, object]] = []
    for match in _QWEN_CALL.finditer(text):
        call: tuple[str, object] | None = _qwen_raw(match.group(0))
        if call is None:
            found = json_prefix(match.group(1))
            call = named_call(found[0]) if found else None
            if found is None or call is None or found[1].strip():
                return None
        calls.append(call)
    return _QWEN_CALL.sub("", text).strip(), calls


def _qwen_raw(block: str) -> tuple[str, str] | None:
    """(name, arguments as written) of a call block in the template's key order, else None."""
    header = _QWEN_HEADER.match(block)
    if header is None:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(block, header.end())
    except json.JSONDecodeError:
        return None
    if not re.fullmatch(r"\s*\}\s*(</tool_call>)?", block[end:]):
        return None
    return header.group(1), block[header.end():end]


def _split_mistral(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    body = text.removeprefix("[TOOL_CALLS]")
    calls: list[tuple[str, object]] = []
    if "[ARGS]" in body:  # v11+ tokenizers: name[ARGS]{...} per call, each after [TOOL_CALLS]
        for part in body.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            found = json_prefix(args)
            if found is None or found[1].strip():
                return None
            calls.append((name.strip(), found[0]))
        return "", calls
    found = json_prefix(body)
    if found is None:
        return None
    value, rest = found
    for item in value if isinstance(value, list) else [value]:
        call = named_call(item)
        if call is None:
            return None
        calls.append(call)
    return rest.strip(), calls


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                      re.DOTALL)
_DS_FENCED = re.compile(r"\A([^\n]+)\n```(?:json)?\n(.*)\n```\s*\Z", re.DOTALL)


def _split_deepseek(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    body, _, after = text.removeprefix("<｜tool▁calls▁begin｜>").partition("<｜tool▁calls▁end｜>")
    calls: list[tuple[str, object]] = []
    for match in _DS_CALL.finditer(body):
        kind, rest = match.group(1), match.group(2)
        if kind == "function":  # V3: type, then name and fenced JSON
            fenced = _DS_FENCED.match(rest)
            if fenced is None:
                return None
            calls.append((fenced.group(1).strip(), fenced.group(2)))
        else:  # V3.1: name, then the arguments
            calls.append((kind.strip(), rest))
    if _DS_CALL.sub("", body).strip():
        return None
    return after.replace("<｜end▁of▁sentence｜>", "").strip(), calls


_DS_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
               "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
_DS_V3_SYNTAX = re.compile(r"<｜tool▁sep｜>'\s*\+\s*tool\[['\"]function['\"]\]\[['\"]name['\"]\]")
"""V3's templates write the function's name after the separator token (V3.1's before it)."""

_CALL = '{"name": "<function name>", "arguments": {<its arguments>}}'
DS_OPEN, DS_CLOSE = DS_CALLS_BEGIN + DS_CALL_BEGIN, DS_CALL_END + DS_CALLS_END
FORMATS = (
    ToolFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", _DS_MARKERS, _split_deepseek,
               grammar=deepseek_v3_forced,
               syntax=f"{DS_OPEN}function{DS_SEP}<function name>\n```json\n{{<its "
                      f"arguments>}}\n```{DS_CLOSE}"),
    ToolFormat("deepseek_v3_1", "<｜tool▁calls▁begin｜>", _DS_MARKERS, _split_deepseek,
               grammar=deepseek_v3_1_forced,
               syntax=f"{DS_OPEN}<function name>{DS_SEP}{{<its arguments>}}{DS_CLOSE}"),
    ToolFormat("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]", "[ARGS]"), _split_mistral,
               _mistral_id, grammar=mistral_forced, syntax=f"[TOOL_CALLS] [{_CALL}]"),
    ToolFormat("qwen", "<tool_call>", ("<tool_call>", "</tool_call>"), _split_qwen,
               header=_QWEN_HEADER, tail=_QWEN_TAIL, grammar=qwen_forced,
               syntax=f"<tool_call>\n{_CALL}\n</tool_call>"),
)
"""Known formats, in the order a template is matched against them."""


def detect(template: str) -> ToolFormat | None:
    """The format whose opening marker the chat template writes, if any (DeepSeek's V3 or V3.1
    by where the template puts the function's name)."""
    for form in FORMATS:
        if form.start in template:
            if form.name == "deepseek_v3" and not _DS_V3_SYNTAX.search(template):
                continue
            return form
    return None
