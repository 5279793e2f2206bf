"""Constrained decoding: the tokenizer's bytes, the sampler's mask (masked tokens never drawn, EOS
only in a final state), answers of the baby model that parse and match their schema, errors."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from json_check import SCHEMAS, check, json_schema_format

from hetmoe import LLM
from hetmoe.engine.requests.constrained import Constraints, ResponseFormat, json_object_regex
from hetmoe.engine.requests.sampler import Sampler, SamplingParams
from hetmoe.engine.requests.token_bytes import token_bytes

JSON_OBJECT = ResponseFormat("json_object")


@pytest.fixture(scope="module")
def llm(llm_of: Callable[[str], LLM]) -> LLM:
    return llm_of("qwen3_moe")


def fresh_constraints(llm: LLM) -> Constraints:
    return Constraints(llm.tokenizer, llm.eos_token_ids, llm.runner.vocab_size)


def test_token_bytes_spell_what_the_tokenizer_decodes(llm: LLM) -> None:
    tokenizer, vocab = llm.tokenizer, llm.runner.vocab_size
    spelled = {i: b for b, ids in token_bytes(tokenizer, vocab).items() for i in ids}
    special = set(tokenizer.all_special_ids) | set(llm.eos_token_ids)
    assert not special & set(spelled)
    assert len(spelled) == vocab - len(special)
    for token_id, raw in spelled.items():
        if raw.decode(errors="replace") == raw.decode(errors="ignore"):  # whole characters
            assert tokenizer.decode([token_id]) == raw.decode(), token_id


def test_sentencepiece_spellings() -> None:
    vocab = {"<s>": 0, "▁a": 1, "<0x0A>": 2, "b▁": 3, "<0x7B>": 4}
    tokenizer = SimpleNamespace(get_vocab=lambda: vocab, all_special_ids=[0],
                                added_tokens_decoder={})
    assert token_bytes(tokenizer, 5) == {b" a": [1], b"\n": [2], b"b ": [3], b"{": [4]}
    assert token_bytes(tokenizer, 3) == {b" a": [1], b"\n": [2]}  # ids past the logits: out


def test_the_mask_is_the_librarys_and_eos_comes_in_final_states_only(llm: LLM) -> None:
    fmt = ResponseFormat.of(json_schema_format("person"))
    assert fmt is not None
    constraint = fresh_constraints(llm).compile(fmt).start()
    eos = list(llm.eos_token_ids)
    for piece in ['{', ' "name"', ':', ' "', 'Al', '"', ', "age":', ' 7', ', "color": "red"', '}']:
        allowed = constraint.allowed()
        library = set(constraint.guide.get_tokens())
        assert set(torch.nonzero(allowed).flatten().tolist()) == library | (
            set(eos) if constraint.guide.is_finished() else set())
        assert not allowed[eos].any()
        for token in llm.tokenizer.encode(piece, add_special_tokens=False):
            constraint.advance(token)
    allowed = constraint.allowed()
    assert constraint.guide.is_finished()
    assert sorted(torch.nonzero(allowed).flatten().tolist()) == sorted(eos)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_masked_tokens_are_never_sampled(llm: LLM, temperature: float) -> None:
    """The forbidden tokens get the largest logits; the sampler never takes one."""
    fmt = ResponseFormat.of(json_schema_format("nested"))
    assert fmt is not None
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0),
                      constraint=fresh_constraints(llm).compile(fmt).start())
    assert sampler.needs_logits and not Sampler(SamplingParams()).needs_logits
    noise = torch.Generator().manual_seed(1)
    tokens: list[int] = []
    while not tokens or tokens[-1] not in llm.eos_token_ids:
        assert sampler.constraint is not None and len(tokens) < 200
        allowed = sampler.constraint.allowed()
        logits = torch.randn(llm.runner.vocab_size, generator=noise)
        logits[~allowed] += 100.0
        tokens.append(sampler(logits))
        assert allowed[tokens[-1]]
        sampler.observe(tokens[-1])
    check(json.loads(llm.decode(tokens)), SCHEMAS["nested"])


def test_json_object_walks_end_in_an_object(llm: LLM) -> None:
    """Random logits that favour closing characters: every walk ends in an object."""
    constraints = fresh_constraints(llm)
    closing = torch.zeros(llm.runner.vocab_size)
    for raw, ids in token_bytes(llm.tokenizer, llm.runner.vocab_size).items():
        if any(c in raw for c in b'"}],'):
            closing[ids] = 4.0
    for seed in range(8):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed),
                          constraint=constraints.compile(JSON_OBJECT).start())
        noise = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        while not tokens or tokens[-1] not in llm.eos_token_ids:
            assert len(tokens) < 400
            tokens.append(sampler(torch.randn(len(closing), generator=noise) + closing))
            sampler.observe(tokens[-1])
        assert isinstance(json.loads(llm.decode(tokens)), dict)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 0.7, "seed": 11, "top_p": 0.9}])
def test_answers_of_the_baby_model_match_the_schema(llm: LLM, name: str,
                                                    sampling: dict[str, float]) -> None:
    out = llm.generate("Hello", max_tokens=200, response_format=json_schema_format(name),
                       **sampling)
    assert out.finish_reason == "stop", out.text
    check(json.loads(out.text), SCHEMAS[name])


def test_a_batch_mixes_constrained_and_free_requests(llm: LLM) -> None:
    fmt = ResponseFormat.of(json_schema_format("tags"))
    free = llm.generate(["Hello", "Hi"], max_tokens=8)
    outs = llm.generate(["Hello", "Hi"], SamplingParams(max_new_tokens=200, response_format=fmt))
    for out in outs:
        check(json.loads(out.text), SCHEMAS["tags"])
    assert llm.generate(["Hello", "Hi"], max_tokens=8) == free


@pytest.mark.parametrize(("value", "message"), [
    ({"type": "json"}, "type must be 'text', 'json_object' or 'json_schema', got 'json'"),
    ({"type": "json_schema"}, "needs json_schema.schema, a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "needs json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "json_schema 'x': outlines-core cannot follow this schema: Unsupported type: foo"),
    ("json", "must be a dict like"),
])
def test_bad_formats_are_named(llm: LLM, value: object, message: str) -> None:
    with pytest.raises(ValueError, match="response_format") as caught:
        llm.generate("Hello", max_tokens=4, response_format=value)
    assert message in str(caught.value)


def test_a_regex_format_is_followed(llm: LLM) -> None:
    """The kind a forced tool call uses: the whole answer matches the pattern, then EOS."""
    fmt = ResponseFormat("regex", name="a greeting", pattern=r"(hi|bye) [0-9]{2}!")
    assert fmt.regex() == fmt.pattern and fmt.label == "a greeting"
    for seed in range(3):
        out = llm.generate("Hello", max_tokens=40, temperature=1.0, seed=seed,
                           response_format=fmt)
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.eos_token_ids
        assert re.fullmatch(r"(hi|bye) [0-9]{2}!", out.text), out.text
    with pytest.raises(ValueError, match="a pattern goes with type 'regex' only"):
        ResponseFormat("regex")
    with pytest.raises(ValueError, match="a pattern goes with type 'regex' only"):
        ResponseFormat("json_object", pattern="x")
    with pytest.raises(ValueError, match="a schema goes with type 'json_schema' only"):
        ResponseFormat("regex", "{}", pattern="x")


def test_an_unspellable_format_is_a_clear_error() -> None:
    vocab = {"<s>": 0, "a": 1}
    tokenizer = SimpleNamespace(get_vocab=lambda: vocab, all_special_ids=[0],
                                added_tokens_decoder={})
    with pytest.raises(ValueError, match="json_object: outlines-core could not build its index"):
        Constraints(tokenizer, [0], 2).compile(JSON_OBJECT)


def test_text_is_free_and_indexes_are_cached(llm: LLM) -> None:
    assert ResponseFormat.of({"type": "text"}) is None
    assert SamplingParams(response_format={"type": "json_object"}).response_format == JSON_OBJECT
    constraints = fresh_constraints(llm)
    started = time.perf_counter()
    first = constraints.compile(JSON_OBJECT)
    assert time.perf_counter() - started < 5.0  # ~0.1 s for the 512-token vocabulary
    assert constraints.compile(ResponseFormat("json_object")) is first
    free_form = ResponseFormat("json_schema", '{"type": "object"}')  # the library's takes ~10 s
    assert free_form.regex() == json_object_regex()
