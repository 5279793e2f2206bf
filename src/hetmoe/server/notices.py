"""What the server did with a request that the client cannot see in the body: response headers
(and a log line) naming the top-level fields it ignored and the tool-call format it used."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hetmoe.server.tools import ToolPlan

log = logging.getLogger("hetmoe.server")

IGNORED_FIELDS = "x-hetmoe-ignored-fields"
"""Header: the request's unknown top-level fields, comma-separated (they had no effect)."""
TOOL_FORMAT = "x-hetmoe-tool-format"
"""Header: the tool-call format of a request with tools (`qwen`, `mistral`, `deepseek_v3`,
`deepseek_v3_1`, or `generic`: JSON calls prompted for a template that renders no tools)."""


_MAX_NAMED = 32
"""Ignored fields named at most (a header stays short whatever the body holds)."""


class _Body(Protocol):
    @property
    def ignored_fields(self) -> list[str]: ...


def notice_headers(route: str, body: _Body, plan: ToolPlan | None) -> dict[str, str]:
    """The headers of a response to `body` on `route`; ignored fields are also logged."""
    headers: dict[str, str] = {}
    ignored = [_shown(name) for name in body.ignored_fields]
    if ignored:
        named = ", ".join(ignored[:_MAX_NAMED])
        if len(ignored) > _MAX_NAMED:
            named += f" (and {len(ignored) - _MAX_NAMED} more)"
        log.warning("%s: ignored unknown request fields: %s", route, named)
        headers[IGNORED_FIELDS] = named
    if plan is not None:
        headers[TOOL_FORMAT] = plan.form.name
    return headers


def _shown(name: str) -> str:
    """A field name as header text: ASCII, at most 64 characters."""
    text = name.encode("ascii", "backslashreplace").decode("ascii")
    return text if len(text) <= 64 else text[:61] + "..."
