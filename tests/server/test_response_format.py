"""`response_format` through the official `openai` client: answers of a random baby model that
parse and match their JSON schema (greedy and sampled, streamed and not, n choices; chat and text
completions), JSON objects, and 400s naming the field for formats that cannot be followed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from json_check import SCHEMAS, check, json_schema_format
from live_server import MODEL, LiveServer
from outlines_core import Guide, Index, Vocabulary

from hetmoe.engine.requests.constrained import json_object_regex

ASK = [{"role": "user", "content": "Describe someone as JSON."}]


def _chat(server: LiveServer, **options: Any) -> Any:
    options.setdefault("max_tokens", 200)
    return server.openai().chat.completions.create(model=MODEL, messages=ASK, **options)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_answers_match_the_schema(server: LiveServer, name: str) -> None:
    reply = _chat(server, temperature=0, response_format=json_schema_format(name))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    check(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_streamed_sampled_answers_match_the_schema(server: LiveServer, name: str) -> None:
    pieces, finish = [], None
    for chunk in _chat(server, temperature=1.0, seed=5, stream=True,
                       response_format=json_schema_format(name)):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    check(json.loads("".join(pieces)), SCHEMAS[name])
    unstreamed = _chat(server, temperature=1.0, seed=5, response_format=json_schema_format(name))
    assert unstreamed.choices[0].message.content == "".join(pieces)


def test_each_of_n_choices_walks_its_own_state(server: LiveServer) -> None:
    reply = _chat(server, temperature=1.0, seed=1, n=3, response_format=json_schema_format("tags"))
    answers = [json.loads(c.message.content) for c in reply.choices]
    for answer in answers:
        check(answer, SCHEMAS["tags"])
    assert len({json.dumps(a) for a in answers}) > 1


def test_json_object_answers_are_objects(server: LiveServer) -> None:
    """Strings may be of any length, so a random model ends only some answers within the
    budget (tests/engine/test_constrained.py ends every walk): those are objects, the others
    begin one (each byte a step of the format's automaton)."""
    reply = _chat(server, temperature=1.0, seed=9, n=8, max_tokens=160,
                  response_format={"type": "json_object"})
    by_byte = Index(json_object_regex(), Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    for choice in reply.choices:
        text = choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        walk = Guide(by_byte)
        for byte in text.encode():
            walk.advance(byte, return_tokens=False)  # ValueError when the text leaves it


def test_text_format_is_free_text(server: LiveServer) -> None:
    free = _chat(server, temperature=0, max_tokens=8)
    text = _chat(server, temperature=0, max_tokens=8, response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


def test_completions_follow_the_format_too(server: LiveServer) -> None:
    """Several prompts x n choices, greedy and sampled, streamed and not, with echo."""
    client, fmt = server.openai(), json_schema_format("person")
    prompts = ["A person as JSON:", "Someone:"]
    options = dict(model=MODEL, prompt=prompts, max_tokens=200, temperature=1.0, seed=4, n=2,
                   extra_body={"response_format": fmt})
    reply = client.completions.create(**options)
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.text
        check(json.loads(choice.text), SCHEMAS["person"])
    texts = {c.index: "" for c in reply.choices}
    for chunk in client.completions.create(stream=True, **options):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in reply.choices}
    echoed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=200,
                                       temperature=0, echo=True,
                                       extra_body={"response_format": fmt})
    assert echoed.choices[0].text.startswith(prompts[0])
    check(json.loads(echoed.choices[0].text[len(prompts[0]):]), SCHEMAS["person"])
    free = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8,
                                     temperature=0)
    text = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == free.choices[0].text


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("response_format", "message"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "json_schema 'x': outlines-core cannot follow this schema: Unsupported type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "needs json_schema.schema, a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}}},
     "Invalid reference path"),
    ({"type": "xml"}, "response_format.type"),
])
def test_formats_that_cannot_be_followed_are_400s(server: LiveServer, route: str,
                                                   response_format: dict[str, Any],
                                                   message: str) -> None:
    prompt = {"messages": ASK} if route == "chat" else {"prompt": "Hello"}
    body = {"model": MODEL, **prompt, "response_format": response_format, "stream": True}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    response = server.api.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("response_format") and message in error["message"]
    assert _chat(server, max_tokens=2).choices[0].finish_reason == "length"  # still serving
