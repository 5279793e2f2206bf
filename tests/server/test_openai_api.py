"""The official `openai` client against a live server: chat, completions, streams, stops, usage."""

from __future__ import annotations

import pytest
from live_server import MODEL, LiveServer

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


def _stream_chat(server: LiveServer, **options: object) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of a streamed chat completion."""
    parts: list[str] = []
    finish, usage = None, None
    chunks = server.openai().chat.completions.create(model=MODEL, stream=True, **options)
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, usage


def test_models_lists_the_served_model(server: LiveServer) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "hetmoe"


def test_chat_streamed_equals_unstreamed_and_counts_usage(server: LiveServer) -> None:
    client = server.openai()
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(server.service.chat_ids([("user", HELLO[0]["content"])]))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 12
    streamed, finish, usage = _stream_chat(
        server, messages=HELLO, max_tokens=12, temperature=0,
        stream_options={"include_usage": True},
    )
    assert (streamed, finish) == (text, full.choices[0].finish_reason)
    assert usage is not None
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == \
        full.usage.model_dump(exclude={"prompt_tokens_details"})
    # The same prompt again: the prefix cache holds all of it but the last token.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_stream_without_include_usage_sends_no_usage(server: LiveServer) -> None:
    _, finish, usage = _stream_chat(server, messages=HELLO, max_tokens=4, temperature=0)
    assert finish in ("stop", "length") and usage is None


def test_chat_equals_the_engine_and_max_completion_tokens_wins(server: LiveServer) -> None:
    client = server.openai()
    reply = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=50, max_completion_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 7 and reply.choices[0].finish_reason == "length"
    # The same ids through the engine's own text path give the same text.
    ids = server.service.chat_ids([("user", HELLO[0]["content"])])
    full = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].text == reply.choices[0].message.content


def test_completions_stream_and_not(server: LiveServer) -> None:
    client = server.openai()
    full = client.completions.create(
        model=MODEL, prompt="The harbour town", max_tokens=10, temperature=0
    )
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(server.service.text_ids("The harbour town"))
    parts = []
    for chunk in client.completions.create(
        model=MODEL, prompt="The harbour town", max_tokens=10, temperature=0, stream=True
    ):
        parts.extend(c.text for c in chunk.choices)
    assert "".join(parts) == full.choices[0].text


# 6 strings: lm-eval's code tasks stop at 5 strings and the EOS text (vLLM takes any number).
@pytest.mark.parametrize("count", [1, 2, 6])
def test_stop_string_cuts_the_answer(server: LiveServer, count: int) -> None:
    client = server.openai()
    base = dict(model=MODEL, prompt="The harbour town", max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    assert len(text) > 8, f"the baby model's answer is too short to cut: {text!r}"
    stop = text[4:7]
    expected = text[: text.index(stop)]
    stops = [*(f"never-there-{i}" for i in range(count - 1)), stop] if count > 1 else stop
    cut = client.completions.create(**base, stop=stops)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    parts = [c.choices[0].text for c in client.completions.create(**base, stop=stops, stream=True)
             if c.choices]
    assert "".join(parts) == expected


def test_seeded_sampling_repeats_and_top_k_extension(server: LiveServer) -> None:
    client = server.openai()

    def sample(seed: int, **extra: object) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True, **extra},
        )
        return reply.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1, "different seeds gave the same text"
    greedy = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].message.content
    assert sample(5, top_k=1) == greedy  # top_k=1 is greedy whatever the temperature
    tiny = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=16, temperature=1e-40,
        extra_body={"ignore_eos": True},
    )
    assert tiny.choices[0].message.content == greedy  # the T -> 0 limit, no overflow


def test_unknown_fields_are_ignored(server: LiveServer) -> None:
    reply = server.openai().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
        extra_body={"frobnicate": {"x": 1}, "user": "someone", "presence_penalty": 0},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_metrics_are_prometheus_text(server: LiveServer) -> None:
    server.openai().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    response = server.api.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'hetmoe_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert server.metric("hetmoe_kv_slots") == 8
    assert server.metric("hetmoe_time_to_first_token_seconds_count") >= 1
    assert server.metric("hetmoe_generated_tokens_total") >= 2
    for name in ("hetmoe_queue_depth", "hetmoe_running_requests", "hetmoe_tokens_per_second"):
        assert f"# TYPE {name} gauge" in text


def test_generation_may_fill_the_context_window_exactly(server: LiveServer) -> None:
    prompt = "The sea is wide, the sea is deep. " * 18
    room = server.service.context_len - len(server.service.text_ids(prompt))
    assert 0 < room < 64, f"the test prompt leaves {room} tokens"
    full = server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=room, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens + full.usage.completion_tokens == server.service.context_len
