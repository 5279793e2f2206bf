"""`hetmoe serve` in a subprocess on a free 127.0.0.1 port, as a user starts it: the demo tests'
live server (lm-eval, tool calls)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def serve(model: str, log_path: Path, *flags: str,
          env: dict[str, str] | None = None) -> Iterator[str]:
    """`hetmoe serve MODEL FLAGS` (its output in `log_path`); yields its base URL once /health
    answers, stops it after."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "hetmoe"), "serve", model, "--port", str(port),
               *flags]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"hetmoe serve did not start:\n{log_path.read_text()}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)
