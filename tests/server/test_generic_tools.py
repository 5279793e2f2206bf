"""Tool calling with a chat template that renders no tools (the baby model's own): the generic
format, as llama.cpp's server falls back to it. The tools and the call syntax go into the system
message, calls are JSON lines (whole, streamed, forced by constrained decoding), the history's
calls and results are written as JSON text, and the response says so in a header."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from json_check import SCHEMAS, check
from live_server import MODEL, TEMPLATES, LiveServer, tiny_llm
from scripted import scripted

from hetmoe.server.service import ModelService
from hetmoe.server.tool_generic import GENERIC, generic_turns, with_tool_prompt
from hetmoe.server.tool_parsers import ToolCall
from hetmoe.server.tools import ToolPlan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
DESCRIBE = {"type": "function", "function": {
    "name": "describe", "description": "Describe a person", "parameters": SCHEMAS["person"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
FORMAT = "x-hetmoe-tool-format"


def _chat(server: LiveServer, **options: Any) -> Any:
    return server.openai().chat.completions.create(model=MODEL, **options)


def test_round_trip_with_a_scripted_call(generic_server: LiveServer) -> None:
    service = generic_server.service
    with scripted(service, "Let me see.\n" + CALL, "It is sunny in Paris.") as model:
        raw = generic_server.openai().chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=64)
        assert raw.headers[FORMAT] == "generic"
        choice = raw.parse().choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
        (call,) = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather",
                                                                 '{"city": "Paris"}')
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        answer = _chat(generic_server, messages=history, tools=[WEATHER], max_tokens=64)
    assert answer.choices[0].message.content == "It is sunny in Paris."
    first, second = (service.tokenizer.decode(ids) for ids in model.prompts)
    definition = json.dumps(WEATHER["function"])
    assert first.startswith("<s><|system|>\nYou can call these tools (JSON Schema function "
                            f"definitions):\n{definition}\n\nTo call a tool")
    assert '{"tool_call": {"name": "<function name>", "arguments": {<its arguments>}}}' in first
    assert first.endswith("<|user|>\nWeather in Paris?</s>\n<|assistant|>\n")
    assert f"<|assistant|>\nLet me see.\n{CALL}</s>" in second  # the call as the model wrote it
    assert ('<|user|>\n{"tool_response": {"name": "get_weather", "content": "sunny, 21 C"}}</s>'
            in second)


def test_streamed_calls_arrive_as_openai_sends_them(generic_server: LiveServer) -> None:
    text = "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    with scripted(generic_server.service, text, text):
        whole = _chat(generic_server, messages=ASK, tools=[WEATHER], max_tokens=64)
        with generic_server.openai().chat.completions.with_streaming_response.create(
                model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=64,
                stream=True) as response:
            assert response.headers[FORMAT] == "generic"
            chunks = list(response.parse())
    arguments = [c.function.arguments for c in whole.choices[0].message.tool_calls]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Checking."
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.function.name) for d in firsts] == [(0, "get_weather"),
                                                            (1, "get_weather")]
    for index, whole_arguments in enumerate(arguments):  # streamed in pieces as generated
        pieces = [d.function.arguments for d in deltas if d.index == index and d.id is None]
        assert len(pieces) > 1 and "".join(pieces) == whole_arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_written_by_the_model(generic_server: LiveServer, stream: bool) -> None:
    """The random model itself, constrained: a named call and `required` calls whose
    arguments match the schema."""
    named = {"type": "function", "function": {"name": "describe"}}
    reply = _chat(generic_server, messages=ASK, tools=[WEATHER, DESCRIBE], tool_choice=named,
                  temperature=0, max_tokens=120)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "describe" and reply.choices[0].finish_reason == "tool_calls"
    check(json.loads(call.function.arguments), SCHEMAS["person"])
    if stream:
        chunks = list(_chat(generic_server, messages=ASK, tools=[WEATHER, DESCRIBE],
                            tool_choice=named, temperature=0, max_tokens=120, stream=True))
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == "describe"
        assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    required = _chat(generic_server, messages=ASK, tools=[WEATHER, DESCRIBE],
                     tool_choice="required", temperature=1.0, seed=4, n=2, max_tokens=200)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        for made in choice.message.tool_calls:
            schema = SCHEMAS["person"] if made.function.name == "describe" else \
                WEATHER["function"]["parameters"]
            check(json.loads(made.function.arguments), schema)


def test_generic_parse_and_history() -> None:
    plan = ToolPlan(GENERIC, [WEATHER], "auto", True)
    paris = ToolCall("get_weather", '{"city": "Paris"}')
    around = plan.parse("Sure.\n" + CALL + " trailing")
    assert around is not None and (around.content, around.calls) == ("Sure.\ntrailing", (paris,))
    reordered = plan.parse('{"tool_call": {"arguments": {"city": "Rome"}, "name": "get_weather"}}')
    assert reordered is not None and reordered.calls == (ToolCall("get_weather",
                                                                  '{"city": "Rome"}'),)
    parsed = plan.parse(CALL + "\n" + CALL)
    assert parsed is not None and parsed.calls == (paris, paris)
    assert plan.parse(CALL[:-5]) is None  # cut: text
    assert plan.parse(CALL.replace("get_weather", "rm")) is None  # not offered: text
    assert plan.parse('{"answer": 42}') is None
    history = [{"role": "system", "content": "Be brief."},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": {"city": "Rome"}}}]},
               {"role": "tool", "content": "rain", "tool_call_id": "c1"}]
    turns = with_tool_prompt(generic_turns(history), [WEATHER], GENERIC)
    assert turns[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert turns[1] == {"role": "assistant", "content": '{"tool_call": {"name": "get_weather", '
                        '"arguments": {"city": "Rome"}}}'}
    assert turns[2] == {"role": "user", "content": '{"tool_response": {"name": "get_weather", '
                        '"content": "rain"}}'}


def test_the_server_log_names_the_fallback(tiny_qwen3_moe: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hetmoe.server"):
        service = ModelService(tiny_llm(tiny_qwen3_moe, max_seq_len=64), "baby", 1)
        service.close()
    assert ("the chat template of baby renders no tools: requests with tools get them in the "
            "system message, calls in the generic format (header x-hetmoe-tool-format: "
            "generic)") in caplog.text


def test_named_templates_are_read_together(tiny_qwen3_moe: Path) -> None:
    """A tokenizer with named templates (`default`, `tool_use`) has its tool template found."""
    llm = tiny_llm(tiny_qwen3_moe, max_seq_len=64)
    plain = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = {"default": plain,
                                   "tool_use": (TEMPLATES / "qwen3.jinja").read_text()}
    service = ModelService(llm, "baby", 1)
    service.close()
    assert service.tool_format is not None and service.tool_format.name == "qwen"
    assert plain in (service.chat_template or "")
