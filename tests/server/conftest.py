"""Fixtures: a live server with a baby model, one per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import API_KEY, LiveServer, tiny_llm

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
