"""One streamed choice of a request with tools: its text turned into content and tool-call deltas
as it is generated.

Content is released as it comes until the format's opening marker may have begun. From there
the text is held. For a format with a call `header` (Qwen / Hermes), a call is announced as soon
as its header names an offered function (`CallStart`, with a fresh id), then its arguments
stream as they are generated (`CallArguments`) until their JSON object closes; the text after a
call is held again. At the end the whole answer is parsed as an unstreamed one is: calls not
streamed yet (other formats, other key orders) come whole, and the content not released yet
comes with them. A call cut inside its arguments (by max_tokens) has streamed as far as it got,
as OpenAI streams it; `finish_reason` says `length`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetmoe.server.tool_parsers import ParsedOutput

if TYPE_CHECKING:
    from hetmoe.server.tools import ToolPlan


@dataclass(frozen=True)
class CallStart:
    """A call begins: its index in the answer, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More text of call `index`'s arguments."""

    index: int
    text: str


Delta = str | CallStart | CallArguments
"""Content text, or a piece of a tool call."""


class _Arguments:
    """Where a JSON value being generated ends: depth of brackets outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.begun = False

    def scan(self, text: str) -> tuple[int, int | None]:
        """Feeds `text`: (blanks before the value begins, the end of the value in `text` or
        None while it goes on)."""
        skip = 0
        for i, char in enumerate(text):
            if not self.begun:
                if char.isspace():
                    skip = i + 1
                    continue
                self.begun = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
            if self.depth <= 0 and not self.in_string:
                return skip, i + 1  # a scalar ends at once: the parse at the end refuses it
        return skip, None


class ToolStream:
    """Feeds a choice's text; returns the deltas that are safe to send."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = plan.prefix
        """The whole answer so far, after the call syntax the prompt ended with (a forced
        reply's prefix: held, never content)."""
        self.streamed: list[CallStart] = []
        """Calls announced so far."""
        self._content = 0  # characters of content released (a prefix of the parsed content)
        self._at = 0  # characters of `text` consumed
        self._held = False  # the opening marker was seen
        self._arguments: _Arguments | None = None  # the call whose arguments are streaming
        self._closed = False  # no more calls stream (a call that is not offered, or not parallel)
        self._tail = False  # a call's arguments ended: its closing text comes next

    def feed(self, piece: str) -> list[Delta]:
        """Adds generated text; the content and call deltas it releases."""
        self.text += piece
        out: list[Delta] = []
        while True:
            before = self._at
            if not self._held:
                self._release_content(out)
            elif self._arguments is not None:
                self._stream_arguments(out)
            else:
                self._next_call(out)
            if self._at == before:
                return out

    def finish(self) -> tuple[list[Delta], ParsedOutput | None]:
        """At the answer's end: the deltas still to send and the parsed calls (None: the answer
        is text, and whatever was not sent goes as content)."""
        parsed = self.plan.parse(self.text[len(self.plan.prefix):])
        if parsed is None:
            rest = "" if self.streamed else self.text[self._at:]
            return ([rest] if rest else []), None
        out: list[Delta] = []
        if len(parsed.content) > self._content:
            out.append(parsed.content[self._content:])
        for index in range(len(self.streamed), len(parsed.calls)):
            call = parsed.calls[index]
            out += [CallStart(index, self.plan.form.new_id(), call.name),
                    CallArguments(index, call.arguments)]
        return out, parsed

    def _release_content(self, out: list[Delta]) -> None:
        start = self.plan.form.start
        at = self.text.find(start, self._at)
        if at >= 0:
            self._held = True
            end = at
        else:
            keep = next((k for k in range(min(len(start) - 1, len(self.text)), 0, -1)
                         if self.text.endswith(start[:k])), 0)
            end = max(self._at, len(self.text) - keep)
        if end > self._at:
            out.append(self.text[self._at:end])
            self._content += end - self._at
            self._at = end

    def _next_call(self, out: list[Delta]) -> None:
        """After the marker: a call's header announces it and starts its arguments."""
        form = self.plan.form
        if self._closed or form.header is None:
            return
        if self._tail and form.tail is not None:  # the previous call's closing text
            tail = form.tail.match(self.text, self._at)
            if tail is None:
                return
            self._at, self._tail = tail.end(), False
        rest = self.text[self._at:]
        if self.streamed:
            at = rest.find(form.start)
            if at < 0 or rest[:at].strip():
                return  # no next call yet, or text between calls (parsed at the end)
            self._at += at
            rest = rest[at:]
        header = form.header.match(rest)
        if header is None:
            return
        offered = {tool["function"]["name"] for tool in self.plan.tools}
        if header.group(1) not in offered or (self.streamed and not self.plan.parallel):
            self._closed = True
            return
        self._at += header.end()
        call = CallStart(len(self.streamed), form.new_id(), header.group(1))
        self.streamed.append(call)
        out.append(call)
        self._arguments = _Arguments()

    def _stream_arguments(self, out: list[Delta]) -> None:
        assert self._arguments is not None
        rest = self.text[self._at:]
        skip, end = self._arguments.scan(rest)
        stop = len(rest) if end is None else end
        if stop > skip:
            out.append(CallArguments(self.streamed[-1].index, rest[skip:stop]))
        self._at += stop
        if end is not None:
            self._arguments, self._tail = None, True
