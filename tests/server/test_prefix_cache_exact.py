"""With torch experts in float32 the prefix cache is exact: a prompt whose KV comes from an
earlier, longer request answers greedily token for token as on a fresh server (the C++ CPU
experts' rounding, and torch's in bf16, depends on how many tokens a call carries, so there a
near tie may go the other way: README)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import API_KEY, MODEL, LiveServer, tiny_llm

from hetmoe.server.config import ServerConfig

SHARED = "Hello! The harbour town woke slowly that morning. Fishing boats rocked against the pier"


@pytest.fixture(scope="module")
def torch_server(tiny_qwen3_moe: Path, one_torch_thread: None) -> Iterator[LiveServer]:
    llm = tiny_llm(tiny_qwen3_moe, experts="torch", dtype="float32", max_batch=2,
                   max_seq_len=256)
    live = LiveServer(llm, ServerConfig(api_key=API_KEY, max_queue=4))
    yield live
    live.close()


def _greedy(server: LiveServer, prompt: str) -> tuple[str, int]:
    reply = server.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                               temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens or 0


def test_kv_of_a_longer_request_gives_the_fresh_answer(torch_server: LiveServer) -> None:
    prefix = torch_server.service.scheduler.prefix
    _greedy(torch_server, SHARED + ", and the baker opened her shutters to the street.")
    shorter = SHARED + "."
    cached_text, cached = _greedy(torch_server, shorter)
    assert cached >= len(torch_server.service.text_ids(SHARED)) - 1  # the longer one's KV
    prefix.enabled = False
    try:
        fresh_text, none = _greedy(torch_server, shorter)
    finally:
        prefix.enabled = True
    assert none == 0 and cached_text == fresh_text
