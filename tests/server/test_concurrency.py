"""Concurrent clients: batched decode gives each the single-client text; disconnects free slots;
a full queue answers 429 at once."""

from __future__ import annotations

import contextlib
import threading

import httpx
import openai
import pytest
from live_server import MODEL, LiveServer

PROMPTS = [
    "Hello!",
    "Where do the gulls go when it storms?",
    "Please write a poem about the sea.",
    "What is your name?",
    "Tell me about the market: apples, onions, cheese.",
    "One, two, three, four",
    "The traveller asked for directions to the station.",
    "How are you today?",
]


def _stream_text(server: LiveServer, prompt: str, start: threading.Barrier | None) -> str:
    client = server.openai()
    if start is not None:
        start.wait()
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=40,
        temperature=0, seed=1234, stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_concurrent_streams_match_single_client_runs(server: LiveServer) -> None:
    alone = [_stream_text(server, prompt, None) for prompt in PROMPTS]
    steps = server.metric("hetmoe_decode_steps_total")
    rows = server.metric("hetmoe_decode_rows_total")

    start = threading.Barrier(len(PROMPTS))
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            results[i] = _stream_text(server, PROMPTS[i], start)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == alone
    # The concurrent run really was batched: several sequences per decode step on average.
    steps = server.metric("hetmoe_decode_steps_total") - steps
    rows = server.metric("hetmoe_decode_rows_total") - rows
    assert rows / steps > 2.0, f"{rows} rows in {steps} decode steps: not batched"


def _long_body(max_tokens: int = 240) -> dict[str, object]:
    return {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
        "stream": True, "ignore_eos": True, "temperature": 0,
    }


def test_stream_disconnect_cancels_and_frees_the_slot(server: LiveServer) -> None:
    server.wait_for("hetmoe_running_requests", 0)
    before = server.metric("hetmoe_generated_tokens_total")
    with server.api.stream("POST", "/v1/chat/completions", json=_long_body()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert len(data) >= 3
        assert server.metric("hetmoe_running_requests") == 1
    server.wait_for("hetmoe_running_requests", 0)
    generated = server.metric("hetmoe_generated_tokens_total") - before
    assert generated < 240, "the request ran to its end instead of being cancelled"


def test_unstreamed_disconnect_cancels(server: LiveServer) -> None:
    server.wait_for("hetmoe_running_requests", 0)
    before = server.metric("hetmoe_generated_tokens_total")
    body = {**_long_body(), "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        server.api.post("/v1/chat/completions", json=body, timeout=0.1)
    server.wait_for("hetmoe_running_requests", 0)
    assert server.metric("hetmoe_generated_tokens_total") - before < 240


def test_full_queue_answers_429_then_recovers(server: LiveServer) -> None:
    server.wait_for("hetmoe_running_requests", 0)
    slots, queue = 8, server.config.max_queue
    with contextlib.ExitStack() as stack:
        for _ in range(slots + queue):
            response = stack.enter_context(
                server.api.stream("POST", "/v1/chat/completions", json=_long_body())
            )
            assert response.status_code == 200
        server.wait_for("hetmoe_running_requests", slots)
        server.wait_for("hetmoe_queue_depth", queue)
        with pytest.raises(openai.RateLimitError) as caught:
            server.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert caught.value.status_code == 429
        expected = f"all 8 slots are busy and {queue} requests wait already (max_queue={queue})"
        assert expected in caught.value.message
    # Closing the streams cancelled them all; the server serves again.
    server.wait_for("hetmoe_running_requests", 0)
    server.wait_for("hetmoe_queue_depth", 0)
    reply = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
