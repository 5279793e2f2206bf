"""`LiveServer`: a real uvicorn server on 127.0.0.1 (free port) in a background thread."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from anthropic import Anthropic
from openai import OpenAI

from hetmoe import LLM
from hetmoe.server.app import build_app
from hetmoe.server.config import ServerConfig
from hetmoe.server.service import ModelService

MODEL = "tiny-moe"
API_KEY = "test-key"
TEMPLATES = Path(__file__).parent / "templates"
"""Chat templates of real model families (templates/README.md)."""


class LiveServer:
    """`build_app` under uvicorn on a free loopback port; `close()` stops it and its scheduler."""

    def __init__(self, llm: LLM, config: ServerConfig) -> None:
        self.service = ModelService(llm, MODEL, config.max_queue)
        self.config = config
        server_config = uvicorn.Config(
            build_app(self.service, config), host="127.0.0.1", port=0, log_level="warning",
            lifespan="off", timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(server_config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # Clients are made once: each one builds an SSL context, a fifth of a second.
        self.api = self.http()
        """Plain HTTP client with the key (raw bodies, headers, streams)."""
        self._openai = OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0)
        self._anthropic = Anthropic(base_url=self.url, api_key=API_KEY, max_retries=0)

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        """A new plain HTTP client sending `key` (None: no Authorization header)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def openai(self) -> OpenAI:
        """The official client pointed at this server (thread-safe, shared)."""
        return self._openai

    def anthropic(self) -> Anthropic:
        """The official Anthropic client pointed at this server (sends `x-api-key`)."""
        return self._anthropic

    def metric(self, name: str) -> float:
        """One unlabelled sample from /metrics."""
        text = self.api.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(f"{name} not in /metrics:\n{text}")

    def wait_for(self, name: str, value: float, timeout: float = 10.0) -> None:
        """Waits until the metric `name` equals `value`."""
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed {self.metric(name)}, expected {value}")
            time.sleep(0.02)

    def close(self) -> None:
        self.api.close()
        self._openai.close()
        self._anthropic.close()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.service.close()


def tiny_llm(path: Path, **options: object) -> LLM:
    """The baby model on the CPU device, fp32."""
    return LLM(path, device="cpu", progress=False, **options)




def template_server(tiny_qwen3_moe: Path, path: Path, template: str,
                    context: int = 1024) -> LiveServer:
    """The baby model served with chat template `template` (a file of `templates/`) and a
    `context`-token window; its files copied into `path`."""
    for item in tiny_qwen3_moe.iterdir():
        shutil.copy(item, path / item.name)
    shutil.copy(TEMPLATES / template, path / "chat_template.jinja")
    return LiveServer(tiny_llm(path, max_batch=4, max_seq_len=context),
                      ServerConfig(api_key=API_KEY, max_queue=4))
