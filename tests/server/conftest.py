"""Fixtures: a live server with a baby model, one per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import API_KEY, LiveServer, template_server, tiny_llm

from hetmoe.server.config import ServerConfig


@pytest.fixture(scope="module")
def server(tiny_qwen3_moe: Path, one_torch_thread: None) -> Iterator[LiveServer]:
    """8 KV slots, 256-token context, API key required, 4 requests may wait."""
    live = LiveServer(
        tiny_llm(tiny_qwen3_moe, max_batch=8, max_seq_len=256),
        ServerConfig(api_key=API_KEY, max_queue=4, max_body_bytes=64 * 1024),
    )
    yield live
    live.close()


@pytest.fixture(scope="module")
def generic_server(tiny_qwen3_moe: Path, one_torch_thread: None) -> Iterator[LiveServer]:
    """The baby model with its own chat template, which renders no tools (generic format)."""
    live = LiveServer(tiny_llm(tiny_qwen3_moe, max_batch=4, max_seq_len=1024),
                      ServerConfig(api_key=API_KEY, max_queue=4))
    yield live
    live.close()


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen3_moe: Path, tmp_path_factory: pytest.TempPathFactory,
                one_torch_thread: None) -> Iterator[LiveServer]:
    """The baby model with Qwen3's chat template (its tool prompt is ~470 tokens)."""
    live = template_server(tiny_qwen3_moe, tmp_path_factory.mktemp("tiny-qwen3-tools"),
                           "qwen3.jinja")
    yield live
    live.close()
