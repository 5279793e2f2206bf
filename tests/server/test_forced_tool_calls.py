"""Forced tool calls by constrained decoding: `tool_choice` `required` or a named function (OpenAI)
and `any` / `tool` (Anthropic) make the random baby model itself write calls in Qwen3's
`<tool_call>` format whose arguments match the function's schema (no scripted text)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from forced_tools import ASK, DESCRIBE, SCHEMA_OF, TAG, check_calls
from json_check import check
from live_server import MODEL, TEMPLATES, LiveServer
from transformers import AutoTokenizer

from hetmoe.server.tool_grammar import arguments_regex, literal, qwen_calls


def _chat(server: LiveServer, **options: Any) -> Any:
    options.setdefault("max_tokens", 120)
    return server.openai().chat.completions.create(model=MODEL, messages=ASK, **options)


def _check_calls(calls: Any, names: set[str]) -> None:
    check_calls(calls, names)
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)


def test_the_grammar_matches_what_the_template_writes(tiny_qwen3_moe: Path) -> None:
    """A call rendered by Qwen3's template is a reply the forced format allows (the regex in
    Python's syntax here: the escapes used are common to both)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    arguments = {"name": "Ada", "age": 36, "color": "blue"}
    history = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "describe",
                                                       "arguments": arguments}}]}]
    text = tokenizer.apply_chat_template(history, tools=[DESCRIBE, TAG], tokenize=False,
                                         chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    reply = text[text.rindex("<tool_call>"):text.rindex("</tool_call>") + len("</tool_call>")]
    functions = [(t["function"]["name"], arguments_regex(t["function"]["parameters"], "f"))
                 for t in (DESCRIBE, TAG)]
    assert re.fullmatch(qwen_calls(functions, parallel=False), reply)
    assert re.fullmatch(qwen_calls(functions, parallel=True), reply + "\n" + reply)
    assert not re.fullmatch(qwen_calls(functions[1:], parallel=True), reply)  # not offered
    assert not re.fullmatch(qwen_calls(functions, parallel=False), reply + "\n" + reply)
    assert literal("a.b-c\n{x}") == r"a\.b\-c\n\{x\}"


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_choice_makes_the_model_call_it(qwen_server: LiveServer, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "describe"}}
    reply = _chat(qwen_server, tools=[DESCRIBE, TAG], tool_choice=named, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    _check_calls([call], {"describe"})
    if stream:  # the same greedy call, its arguments assembled from the deltas
        chunks = list(_chat(qwen_server, tools=[DESCRIBE, TAG], tool_choice=named, temperature=0,
                            stream=True))
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == "describe" and deltas[0].id
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments
        assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_required_calls_offered_functions_in_every_choice(qwen_server: LiveServer) -> None:
    reply = _chat(qwen_server, tools=[DESCRIBE, TAG], tool_choice="required", temperature=1.0,
                  seed=3, n=3, max_tokens=220)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        _check_calls(choice.message.tool_calls, {"describe", "tag.items-v2"})
    single = _chat(qwen_server, tools=[DESCRIBE, TAG], tool_choice="required", temperature=1.0,
                   seed=3, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_anthropic_any_and_tool_choices_make_tool_uses(qwen_server: LiveServer) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in (DESCRIBE, TAG)]
    client = qwen_server.anthropic()
    for choice, names in (({"type": "any"}, {"describe", "tag.items-v2"}),
                          ({"type": "tool", "name": "tag.items-v2"}, {"tag.items-v2"})):
        reply = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=tools,
                                       tool_choice=choice, extra_body={"temperature": 0})
        assert reply.stop_reason == "tool_use"
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses and all(u.name in names for u in uses)
        for use in uses:
            check(use.input, SCHEMA_OF[use.name])


def test_parameters_the_library_cannot_follow_are_named(qwen_server: LiveServer) -> None:
    bad = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"type": "unknown"}}}}}
    body = {"model": MODEL, "messages": ASK, "tools": [bad], "tool_choice": "required"}
    response = qwen_server.api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert "the parameters of 'odd'" in error["message"] and "Unsupported type" in error["message"]
    auto = qwen_server.api.post("/v1/chat/completions", json={**body, "tool_choice": "auto",
                                                               "max_tokens": 2})
    assert auto.status_code == 200, auto.text  # `auto` constrains nothing
