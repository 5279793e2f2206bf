"""`n` choices with per-choice seeds, stop lists, penalties and min_p through the `openai`
client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import MODEL, LiveServer, tiny_llm

from hetmoe import LLM

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def oracle(tiny_qwen3_moe: Path, one_torch_thread: None) -> Iterator[LLM]:
    """The same model in an engine of its own."""
    yield tiny_llm(tiny_qwen3_moe, max_batch=2, max_seq_len=256)


def test_n_seeded_choices_are_distinct_reproducible_and_per_choice(server: LiveServer) -> None:
    client = server.openai()
    options = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(n=3, **options)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert reply.usage.completion_tokens == 36
    prompt = server.service.chat_ids([("user", HELLO[0]["content"])])
    assert reply.usage.prompt_tokens == len(prompt)
    again = client.chat.completions.create(n=3, **options)
    assert [c.message.content for c in again.choices] == texts
    # Choice i is the request with seed + i alone: the shared prefill changes nothing.
    for i, text in enumerate(texts):
        alone = client.chat.completions.create(**{**options, "seed": 7 + i})
        assert alone.choices[0].message.content == text


def test_n_choices_stream_by_index(server: LiveServer) -> None:
    client = server.openai()
    options = dict(model=MODEL, prompt="The harbour town", max_tokens=8, temperature=1.0,
                   seed=3, n=2)
    full = client.completions.create(**options)
    parts = {0: "", 1: ""}
    finished = set()
    for chunk in client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            parts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [parts[0], parts[1]] == [c.text for c in full.choices]
    chat_parts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                                temperature=1.0, seed=3, n=2, stream=True):
        for choice in chunk.choices:
            chat_parts[choice.index] += choice.delta.content or ""
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6,
                                          temperature=1.0, seed=3, n=2)
    assert [chat_parts[0], chat_parts[1]] == [c.message.content for c in chat.choices]


def test_penalties_and_min_p_reach_the_sampler(server: LiveServer, oracle: LLM) -> None:
    client = server.openai()
    ids = oracle.encode("The harbour town woke slowly")
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    penalized = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, presence_penalty=-2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 0.7}).choices[0].text
    want = oracle.generate(ids, max_new_tokens=16, presence_penalty=-2.0,
                           repetition_penalty=0.7)
    assert penalized == want.text != greedy
    frequency = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, frequency_penalty=-1.5,
        extra_body={"ignore_eos": True}).choices[0].text
    assert frequency == oracle.generate(ids, max_new_tokens=16, frequency_penalty=-1.5).text
    # min_p = 1 keeps the most likely token only: sampling at any temperature is greedy.
    top_only = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=1.5, seed=1,
        extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text
    assert top_only == greedy


def test_stop_list_ends_every_choice(server: LiveServer) -> None:
    client = server.openai()
    options = dict(model=MODEL, prompt="The harbour town", max_tokens=40, temperature=1.0,
                   seed=11, n=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**options)
    text = full.choices[0].text
    stops = [text[5:7], text[20:22] or "zz"]
    cut = client.completions.create(stop=stops, **options)
    for whole, choice in zip(full.choices, cut.choices, strict=True):
        hits = [whole.text.find(s) for s in stops if s in whole.text]
        if hits:
            assert choice.text == whole.text[: min(hits)] and choice.finish_reason == "stop"
        else:
            assert choice.text == whole.text


def test_second_turn_hits_the_prefix_cache_with_identical_output(server: LiveServer,
                                                                 oracle: LLM) -> None:
    client = server.openai()
    first = [{"role": "user", "content": "Where do the gulls go when it storms?"}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=10,
                                           temperature=0)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the fishermen?"}]
    answer = client.chat.completions.create(model=MODEL, messages=second, max_tokens=12,
                                            temperature=0)
    prompt = server.service.chat_ids([(m["role"], m["content"]) for m in second])
    assert answer.usage.prompt_tokens == len(prompt)
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert len(server.service.chat_ids([("user", first[0]["content"])])) <= cached < len(prompt)
    oracle.scheduler.prefix.enabled = False
    try:
        fresh = oracle.generate(prompt, max_new_tokens=12)
    finally:
        oracle.scheduler.prefix.enabled = True
    assert answer.choices[0].message.content == fresh.text
