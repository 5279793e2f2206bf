"""Log-probabilities and echo through the official `openai` client, against a full forward of a
second engine on the same weights (`LLM.logits`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from live_server import MODEL, LiveServer, tiny_llm

from hetmoe import LLM

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def oracle(tiny_qwen3_moe: Path, one_torch_thread: None) -> Iterator[LLM]:
    """The same model in an engine of its own (the server's runner belongs to its loop)."""
    yield tiny_llm(tiny_qwen3_moe, max_batch=2, max_seq_len=256)


def full_logprobs(oracle: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of a full forward of `ids`, float64 [T, V]."""
    return torch.log_softmax(oracle.logits(ids).double(), dim=-1)


def test_chat_logprobs_equal_a_full_forward(server: LiveServer, oracle: LLM) -> None:
    reply = server.openai().chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5)
    prompt = server.service.chat_ids([("user", HELLO[0]["content"])])
    generated = oracle.generate(prompt, max_new_tokens=8).token_ids
    full = full_logprobs(oracle, prompt + generated)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(generated)
    text = server.service.token_text
    for j, (entry, token) in enumerate(zip(content, generated, strict=True)):
        row = full[len(prompt) - 1 + j]
        assert entry.bytes == list(text(token)[1]) and entry.token == text(token)[0]
        assert abs(entry.logprob - float(row[token])) <= TOL
        values, ids = row.topk(5)
        assert [t.bytes for t in entry.top_logprobs] == [list(text(i)[1]) for i in ids.tolist()]
        assert max(abs(t.logprob - float(v)) for t, v in zip(entry.top_logprobs, values,
                                                             strict=True)) <= TOL
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top token
    # The tokens' bytes make the reply's text.
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined.startswith(reply.choices[0].message.content)


def test_chat_logprobs_stream_equals_unstreamed(server: LiveServer) -> None:
    client = server.openai()
    options = dict(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, logprobs=True,
                   top_logprobs=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**options)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **options):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert [e.model_dump() for e in streamed] == \
        [e.model_dump() for e in full.choices[0].logprobs.content]
    assert len(streamed) == 10
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                          logprobs=True)
    assert all(e.top_logprobs == [] for e in only.choices[0].logprobs.content)


def test_completions_echo_scores_the_prompt(server: LiveServer, oracle: LLM) -> None:
    ids = oracle.encode("The harbour town woke slowly that morning")
    reply = server.openai().completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=3)
    choice = reply.choices[0]
    generated = oracle.generate(ids, max_new_tokens=1).token_ids
    full = full_logprobs(oracle, ids + generated)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(ids[1:] + generated, start=1):
        assert abs(lp.token_logprobs[i] - float(full[i - 1, token])) <= TOL
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and abs(top[lp.tokens[i]] - lp.token_logprobs[i]) <= TOL
        assert 3 <= len(top) <= 4  # the 3 most likely, and the token itself
        assert abs(max(top.values()) - float(full[i - 1].max())) <= TOL
    # lm-evaluation-harness's greedy test: the generated token is the most likely.
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.text.startswith(oracle.decode(ids))
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1


def test_completions_batch_echo_and_stream(server: LiveServer, oracle: LLM) -> None:
    prompts = [oracle.encode("The baker opened"), oracle.encode("Where do the gulls go")]
    client = server.openai()
    options = dict(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, echo=True,
                   logprobs=1, extra_body={"ignore_eos": True})
    reply = client.completions.create(**options)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, ids in zip(reply.choices, prompts, strict=True):
        alone = client.completions.create(**{**options, "prompt": ids}).choices[0]
        assert choice.text == alone.text and choice.logprobs.tokens == alone.logprobs.tokens
        # Batched with another prompt or alone: the same scores, up to summation order.
        pairs = zip(choice.logprobs.token_logprobs[1:], alone.logprobs.token_logprobs[1:],
                    strict=True)
        assert max(abs(a - b) for a, b in pairs) <= TOL
        assert len(choice.logprobs.tokens) == len(ids) + 3
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert reply.usage.completion_tokens == 6
    merged: dict[int, dict[str, list]] = {0: {}, 1: {}}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **options):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                for key, values in c.logprobs.model_dump().items():
                    merged[c.index].setdefault(key, []).extend(values)
    for choice in reply.choices:
        assert texts[choice.index] == choice.text
        assert merged[choice.index] == choice.logprobs.model_dump()


def test_completions_max_tokens_0_with_echo_scores_the_prompt_only(server: LiveServer,
                                                                   oracle: LLM) -> None:
    """lm-eval's and vLLM's prompt scoring: the prompt and its logprobs, nothing generated."""
    ids = oracle.encode("The harbour town woke slowly that morning")
    client = server.openai()
    options = dict(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    reply = client.completions.create(**options)
    choice = reply.choices[0]
    lp = choice.logprobs
    text = server.service.token_text
    assert lp.tokens == [text.label(t) for t in ids] and lp.token_logprobs[0] is None
    full = full_logprobs(oracle, ids)
    for i, token in enumerate(ids[1:], start=1):
        assert abs(lp.token_logprobs[i] - float(full[i - 1, token])) <= TOL
        assert 2 <= len(lp.top_logprobs[i]) <= 3
    assert choice.text == server.service.text(ids) and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
    # The prompt part of a max_tokens=1 echo, without its generated token.
    one = client.completions.create(**{**options, "max_tokens": 1}).choices[0].logprobs
    assert one.tokens[:-1] == lp.tokens and one.token_logprobs[:-1] == lp.token_logprobs
    merged: dict[str, list] = {}
    finishes, texts, usage = [], "", None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **options):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts += c.text
            finishes.append(c.finish_reason)
            for key, values in (c.logprobs.model_dump() if c.logprobs else {}).items():
                merged.setdefault(key, []).extend(values)
    assert texts == choice.text and merged == lp.model_dump()
    assert [f for f in finishes if f] == ["length"] and usage.completion_tokens == 0
    # Several text prompts and n choices: each the same prompt-only answer.
    prompts = ["The baker opened", "Where do the gulls go"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, n=2)
    assert [c.text for c in many.choices] == [p for p in prompts for _ in range(2)]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in many.choices)
    assert many.usage.completion_tokens == 0


BOOLEAN = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
"""After `true` / `false` only EOS may come: every answer ends with the model's EOS token."""


def test_the_eos_token_that_ends_an_answer_has_its_logprob(server: LiveServer,
                                                           oracle: LLM) -> None:
    """As vLLM (its output's token_ids and logprobs keep the EOS token that stopped it) and
    OpenAI's completions (`<|endoftext|>` last in `tokens`): the EOS token is the answer's last
    logprobs entry, with the model's own log-probability, and counts in completion_tokens."""
    client, text = server.openai(), server.service.token_text
    prompt = server.service.chat_ids([("user", HELLO[0]["content"])])
    generated = oracle.generate(prompt, max_new_tokens=20, response_format=BOOLEAN).token_ids
    eos = generated[-1]
    assert eos in oracle.eos_token_ids and len(generated) < 20
    full = full_logprobs(oracle, prompt + generated)
    expected = [float(full[len(prompt) - 1 + j, t]) for j, t in enumerate(generated)]
    options = dict(model=MODEL, messages=HELLO, max_tokens=20, temperature=0, logprobs=True,
                   top_logprobs=1, response_format=BOOLEAN)
    reply = client.chat.completions.create(**options)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content in (
        "true", "false")
    assert [e.bytes for e in content] == [list(text(t)[1]) for t in generated]
    assert content[-1].token == text(eos)[0] and "<" not in reply.choices[0].message.content
    assert max(abs(e.logprob - v) for e, v in zip(content, expected, strict=True)) <= TOL
    assert reply.usage.completion_tokens == len(generated)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **options)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.bytes for e in streamed] == [e.bytes for e in content]
    assert max(abs(e.logprob - v) for e, v in zip(streamed, expected, strict=True)) <= TOL
    # Completions of the same prompt ids: the same last entry, after the text (it adds none).
    for echo in (False, True):
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                               temperature=0, logprobs=1, echo=echo,
                                               extra_body={"response_format": BOOLEAN})
        choice = completion.choices[0]
        lp = choice.logprobs
        assert lp.tokens[-len(generated):] == [text.label(t) for t in generated]
        assert lp.tokens[-1] == text.label(eos) and choice.finish_reason == "stop"
        assert abs(lp.token_logprobs[-1] - expected[-1]) <= TOL
        assert text.label(eos) in lp.top_logprobs[-1]
        if not echo:
            assert lp.text_offset[-1] == len(choice.text) == len(reply.choices[0].message.content)


def test_token_bytes_rebuild_the_text(server: LiveServer, oracle: LLM) -> None:
    text = server.service.token_text
    sample = "Héllo wörld — 42 ☕ gulls"
    bos, *ids = oracle.encode(sample)
    assert b"".join(text(t)[1] for t in ids).decode() == sample
    assert text(bos) == ("<s>", b"<s>")  # a special token is its own text
    partial = [t for t in ids if text(t)[0] == "\ufffd"]
    assert partial, "the sample should split a character across tokens"
    raw = text(partial[0])[1]
    assert text.label(partial[0]) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
