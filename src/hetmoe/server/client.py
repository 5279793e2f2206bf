"""A small streaming client of a running hetmoe (or any OpenAI-compatible) server: `chat --url`.

Standard library only, so the CLI needs nothing beyond the package's own dependencies.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from hetmoe.chat_session import ChatSession


class ServerError(Exception):
    """The server answered an error (its message is shown as is) or could not be reached."""


class ChatClient:
    """Chat completions against `url` (`http://host:port`, with or without `/v1`)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self.timeout = timeout

    def check(self, model: str, timeout: float = 10.0) -> None:
        """Asks the server for its models (GET /v1/models); ServerError naming the URL when it
        cannot be reached, refuses (a wrong key) or does not serve `model`."""
        try:
            with self._open("/models", None, timeout) as response:
                listed = json.load(response)
        except ServerError as exc:
            raise ServerError(f"no hetmoe (or OpenAI-compatible) server answers at {self.base}: "
                              f"{exc}") from None
        except ValueError:
            listed = None
        data = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(data, list):
            raise ServerError(f"{self.base}/models did not answer with a model list: is "
                              f"{self.base} an OpenAI-compatible server?")
        served = [m.get("id") for m in data if isinstance(m, dict)]
        if model not in served:
            names = ", ".join(repr(name) for name in served) or "no model"
            raise ServerError(f"the server at {self.base} serves {names}, not {model!r}")

    def stream(self, messages: list[dict[str, str]], model: str, **sampling: Any) -> Iterator[str]:
        """Yields the answer's text pieces as the server streams them."""
        body = {"model": model, "messages": messages, "stream": True, **sampling}
        with self._open("/chat/completions", body) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        yield piece

    def _open(self, path: str, body: dict[str, Any] | None,
              timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise ServerError(f"{exc.code} from {self.base + path}: {_message(exc)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise ServerError(f"cannot reach {self.base + path}: {reason}") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(exc)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)


def remote_chat(
    client: ChatClient,
    model: str,
    read: Callable[[str], str],
    write: Callable[[str], None],
    system: str | None = None,
    **sampling: Any,
) -> None:
    """The `chat --url` loop (`ChatSession`: commands, multi-line input); EOF or /exit ends.

    A failed turn (e.g. the history outgrew the context window) is reported and dropped.
    """

    def answer(history: list[dict[str, str]]) -> str | None:
        pieces = []
        try:
            for piece in client.stream(history, model, **sampling):
                pieces.append(piece)
                write(piece)
        except ServerError as exc:
            write(f"[error: {exc}]\n")
            return None
        write("\n")
        return "".join(pieces)

    ChatSession(read, write, system).run(answer)
