"""ASGI middleware in front of every route: Host check, API key, bounded body, request counts."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hetmoe.server.errors import ANTHROPIC_PATHS, error_response
from hetmoe.server.metrics import Metrics

# Routes open without a key: liveness for orchestrators, and the static chat page (it holds no
# data; the page itself sends the key on every API call).
PUBLIC_PATHS = frozenset({"/health", "/", "/static/app.js", "/static/style.css"})
# Host names a loopback-bound server answers to: a web page whose DNS name was rebound to
# 127.0.0.1 sends its own name and is refused.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})
# Routes counted under their own label; anything else is "other" (clients choose paths).
KNOWN_ROUTES = frozenset(
    {"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/health",
     "/metrics", "/", "/tokenize", "/detokenize", "/tokenizer_info"}
)


class Guard:
    """Checks the Host and the key, reads the body up to a limit, then hands a replay of it to
    the app. `allowed_hosts` None accepts any Host (a server bound beyond loopback)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        allowed_hosts: frozenset[str] | None,
    ) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send)
        finally:
            # 499: the client went away before any response started.
            self.metrics.request_done(route, status_seen[0] if status_seen else 499)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if self.allowed_hosts is not None:
            host = _host_name(_header(scope, b"host") or "")
            if host not in self.allowed_hosts:
                reply = error_response(
                    400, f"Host {host!r} is not served here: this server answers to "
                    f"{', '.join(sorted(self.allowed_hosts))}", path=path
                )
                await reply(scope, receive, send)
                return
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            if not _authorized(scope, self.api_key):
                header = "x-api-key: <key>" if path in ANTHROPIC_PATHS else \
                    "Authorization: Bearer <key>"
                reply = error_response(
                    401, f"missing or invalid API key: send '{header}'", path=path
                )
                reply.headers["www-authenticate"] = "Bearer"
                await reply(scope, receive, send)
                return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            reply = error_response(413, self._too_large(declared), path=path)
            await reply(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                reply = error_response(413, self._too_large(f"more than {size}"), path=path)
                await reply(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the client's disconnect

        await self.app(scope, replay, send)

    def _too_large(self, found: str) -> str:
        return f"request body too large: {found} bytes, the limit is {self.max_body_bytes} bytes"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _host_name(value: str) -> str:
    """`name:port` or `[v6]:port` -> the name, lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _authorized(scope: Scope, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
    # Constant-time comparison: the key must not leak through response timing.
    expected = api_key.encode()
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
        return True
    other = _header(scope, b"x-api-key")
    return other is not None and hmac.compare_digest(other.strip().encode(), expected)
