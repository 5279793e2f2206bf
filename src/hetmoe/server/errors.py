"""OpenAI-shaped errors: one exception type, one body shape, pydantic errors named by field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
# Anthropic's error types by status (its API answers `{"type": "error", "error": {...}}`).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = frozenset({"/v1/messages"})
"""Routes whose errors take Anthropic's shape."""
# Union members and validator wrappers that pydantic puts in an error's location.
_LOC_TAGS = {"str", "int", "float", "bool", "none"}


class APIError(Exception):
    """An error answered to the client as `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self, path: str = "") -> JSONResponse:
        """The JSON response the clients of the route at `path` parse into their own
        exception types."""
        return error_response(self.status, self.message, self.param, path)


def error_response(status: int, message: str, param: str | None = None,
                   path: str = "") -> JSONResponse:
    """`{"error": {"message", "type", "param", "code"}}` with the given status; on Anthropic's
    routes `{"type": "error", "error": {"type", "message"}}`."""
    if path in ANTHROPIC_PATHS:
        return JSONResponse(anthropic_error(status, message), status_code=status)
    body: dict[str, Any] = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body (also the data of a stream's `error` event)."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _field_path(loc: tuple[int | str, ...]) -> str:
    """`('messages', 0, 'content', 'str')` -> `messages[0].content`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _LOC_TAGS or "[" in part or "-" in part:
            continue
        else:
            path += f".{part}" if path else part
    return path


def from_validation(exc: ValidationError) -> APIError:
    """A 400 naming the first offending field (invalid JSON is its own message)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        detail = str(first["msg"]).removeprefix("Invalid JSON: ")
        return APIError(400, f"request body is not valid JSON: {detail}")
    field = _field_path(tuple(first["loc"]))
    if not field:
        return APIError(400, f"request body: {first['msg']}")
    shown = first.get("input")
    found = "" if first["type"] == "missing" else f" (got {_short(shown)})"
    return APIError(400, f"field '{field}': {first['msg']}{found}", param=field)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
