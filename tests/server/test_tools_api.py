"""Tool calling through the official `openai` client against a live server whose baby model has
Qwen3's real chat template: tools rendered, calls parsed (whole and streamed), a round trip with
the tool's result, `tool_choice`, and the fields refused by name."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from live_server import MODEL, LiveServer
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
from scripted import scripted

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat(server: LiveServer, **options: Any) -> Any:
    return server.openai().chat.completions.create(model=MODEL, **options)


def _prompt(server: LiveServer, ids: list[int]) -> str:
    return server.service.text(ids)


def test_round_trip_with_a_scripted_tool(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, CALL, "It is sunny in Paris.") as model:
        reply = _chat(qwen_server, messages=ASK, tools=[WEATHER, TIME], max_tokens=64)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert (call.function.name, json.loads(call.function.arguments)) == \
            ("get_weather", {"city": "Paris"})
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        answer = _chat(qwen_server, messages=history, tools=[WEATHER, TIME], max_tokens=64)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    first, second = (_prompt(qwen_server, ids) for ids in model.prompts)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in first
    assert '"name": "get_time"' in first and first.endswith("<|im_start|>assistant\n")
    # The second prompt holds the call as the template writes it and the tool's answer.
    assert CALL in second and "<tool_response>\nsunny, 21 C\n</tool_response>" in second
    assert second.startswith(first)


def test_streamed_calls_arrive_as_openai_sends_them(qwen_server: LiveServer) -> None:
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    with scripted(qwen_server.service, text, text):
        whole = _chat(qwen_server, messages=ASK, tools=[WEATHER], max_tokens=64)
        chunks = list(_chat(qwen_server, messages=ASK, tools=[WEATHER], max_tokens=64,
                            stream=True))
    assert whole.choices[0].message.content == "Let me check."
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content.strip() == "Let me check." and "<tool" not in content
    deltas: list[ChoiceDeltaToolCall] = [d for c in chunks for d in c.choices[0].delta.tool_calls
                                         or []]
    # Per call: a delta with index, id, type and name (arguments ""), then its arguments in
    # pieces as they are generated (3 characters per scripted event).
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in firsts] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_weather", "")]
    pieces = {i: [d for d in deltas if d.index == i and d.id is None] for i in (0, 1)}
    assert all(d.function.name is None and d.type is None for p in pieces.values() for d in p)
    assert deltas.index(firsts[1]) > deltas.index(pieces[0][-1])  # one call after the other
    arguments = [call.function.arguments for call in whole.choices[0].message.tool_calls]
    assert ["".join(d.function.arguments for d in pieces[i]) for i in (0, 1)] == arguments
    assert len(pieces[0]) >= len(arguments[0]) // 3 - 1
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["tool_calls"]


def test_a_broken_call_is_text_whole_and_a_cut_call_streamed(qwen_server: LiveServer) -> None:
    """Unstreamed, a call that does not parse leaves the answer as text; streamed, the call
    went out as it was generated, as OpenAI streams one cut by max_tokens (finish `length`)."""
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    with scripted(qwen_server.service, broken, broken, finish_reason="length"):
        whole = _chat(qwen_server, messages=ASK, tools=[WEATHER], max_tokens=64)
        chunks = list(_chat(qwen_server, messages=ASK, tools=[WEATHER], max_tokens=64,
                            stream=True))
    assert whole.choices[0].message.content == broken
    assert whole.choices[0].finish_reason == "length" and not whole.choices[0].message.tool_calls
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == '{"city": "Par'
    assert chunks[-1].choices[0].finish_reason == "length"
    unknown = broken.replace("get_weather", "rm_rf").replace('"Par', '"x"}}\n</tool_call>')
    with scripted(qwen_server.service, unknown):  # a function that was not offered: text
        chunks = list(_chat(qwen_server, messages=ASK, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == unknown
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_required_and_named_choices(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, "No tools needed.", "No tools needed.", CALL,
                  CALL) as model:
        with pytest.raises(openai.UnprocessableEntityError, match="without a tool call"):
            _chat(qwen_server, messages=ASK, tools=[WEATHER], tool_choice="required")
        with pytest.raises(openai.APIError, match="without a tool call"):
            list(_chat(qwen_server, messages=ASK, tools=[WEATHER], tool_choice="required",
                       stream=True))
        named = {"type": "function", "function": {"name": "get_time"}}
        with pytest.raises(openai.UnprocessableEntityError, match="a call of 'get_time'"):
            _chat(qwen_server, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
        reply = _chat(qwen_server, messages=ASK, tools=[WEATHER, TIME],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    # A named choice renders only that function.
    assert '"get_time"' in _prompt(qwen_server, model.prompts[2])
    assert '"get_time"' not in _prompt(qwen_server, model.prompts[3])


def test_parallel_tool_calls_false_keeps_the_first(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, CALL + "\n" + CALL.replace("Paris", "Rome")):
        reply = _chat(qwen_server, messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_model_itself_with_tools(qwen_server: LiveServer) -> None:
    """The random model writes no call: its text comes back, never an error; `none` renders no
    tools."""
    service = qwen_server.service
    reply = _chat(qwen_server, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage.prompt_tokens == len(service.render(ASK, [WEATHER]))
    plain = _chat(qwen_server, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert plain.usage.prompt_tokens == len(service.render(ASK)) < reply.usage.prompt_tokens


@pytest.mark.parametrize(("options", "param", "message"), [
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "'x' is not among 'tools' (get_weather)"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "names must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "should match pattern"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be the tool call that tool_choice 'required' demands"),
    ({"functions": [WEATHER["function"]]}, "functions", "send 'tools'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "needs the tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0]", "only assistant messages carry tool_calls"),
])
def test_bad_tool_fields_are_named(qwen_server: LiveServer, options: dict[str, Any], param: str,
                                   message: str) -> None:
    body = {"model": MODEL, "messages": ASK, **options}
    response = qwen_server.api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_template_without_tools_gets_the_generic_format(server: LiveServer) -> None:
    """The baby model's own template renders no tools: the generic format (whose prompt does
    not fit this server's 256-token window here); `none` renders no tools."""
    with pytest.raises(openai.BadRequestError, match="the prompt has"):
        server.openai().chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    reply = server.openai().chat.completions.create(  # `none`: the tools are not rendered
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
