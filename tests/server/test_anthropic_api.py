"""The official `anthropic` client against a live server's /v1/messages: the same answers as the
OpenAI route, its stream events, stop sequences, tool use, and errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from live_server import MODEL, LiveServer
from scripted import scripted

ASK = [{"role": "user", "content": "Hello! How are you today?"}]
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _create(server: LiveServer, **options: Any) -> Any:
    """`messages.create`; the SDK has no sampling arguments (newer Claude models take none), so
    temperature / top_p / top_k go as extra body fields, which this server reads."""
    sampling = {k: options.pop(k) for k in ("temperature", "top_p", "top_k") if k in options}
    return server.anthropic().messages.create(model=MODEL, extra_body=sampling, **options)


def test_message_equals_the_openai_route(server: LiveServer) -> None:
    reply = _create(server, max_tokens=12, messages=ASK, temperature=0, system="Be brief.")
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", MODEL)
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    same = server.openai().chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ASK])
    assert reply.content[0].text == same.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[same.choices[0].finish_reason]
    assert reply.stop_reason == expected and reply.stop_sequence is None
    prompt = server.service.chat_ids([("system", "Be brief."), ("user", ASK[0]["content"])])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == same.usage.completion_tokens


def test_stream_events_and_final_message(server: LiveServer) -> None:
    whole = _create(server, max_tokens=10, messages=ASK, temperature=0)
    with server.anthropic().messages.stream(model=MODEL, max_tokens=10, messages=ASK,
                                            extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens)
    # Greedy: a sampled reply may spend its 4 tokens on text that is not whole yet (no delta).
    events = [e.type for e in _create(server, max_tokens=4, messages=ASK, stream=True,
                                      temperature=0)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_stop_sequences_name_the_one_that_stopped(server: LiveServer) -> None:
    full = _create(server, max_tokens=30, messages=ASK, temperature=0).content[0].text
    assert len(full) > 12
    stop = full[8:12]
    reply = _create(server, max_tokens=30, messages=ASK, temperature=0,
                    stop_sequences=["never seen", stop])
    assert reply.content[0].text == full[: full.index(stop)]
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    delta = [e for e in _create(server, max_tokens=30, messages=ASK, temperature=0,
                                stop_sequences=[stop], stream=True) if e.type == "message_delta"]
    assert (delta[0].delta.stop_reason, delta[0].delta.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_round_trip(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, CALL, CALL, "Sunny.") as model:
        reply = _create(qwen_server, max_tokens=64, tools=[WEATHER],
                        messages=[{"role": "user", "content": "Weather in Paris?"}])
        with qwen_server.anthropic().messages.stream(
                model=MODEL, max_tokens=64, tools=[WEATHER],
                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
            streamed = stream.get_final_message()
        (use,) = reply.content
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": [use.model_dump()]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        answer = _create(qwen_server, max_tokens=64, tools=[WEATHER], messages=history)
    assert reply.stop_reason == "tool_use" == streamed.stop_reason
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert [(b.type, b.name, b.input) for b in streamed.content] == \
        [("tool_use", "get_weather", {"city": "Paris"})]
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"
    prompt = qwen_server.service.text(model.prompts[2])
    assert CALL in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    assert '"name": "get_weather", "description": "Weather of a city"' in prompt


def test_tool_use_input_streams_as_it_is_generated(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, "Let me look.\n" + CALL):
        events = list(_create(qwen_server, max_tokens=64, tools=[WEATHER], stream=True,
                              messages=[{"role": "user", "content": "Weather in Paris?"}]))
    blocks = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert blocks == [(0, "text"), (1, "tool_use")]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert stops == [0, 1]
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text.strip() == "Let me look."
    pieces = [e.delta.partial_json for e in events
              if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == {"city": "Paris"}
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert delta.delta.stop_reason == "tool_use"


def test_tool_choice_any_without_a_call(qwen_server: LiveServer) -> None:
    with scripted(qwen_server.service, "No.", "No."):
        with pytest.raises(anthropic.UnprocessableEntityError, match="without a tool call"):
            _create(qwen_server, max_tokens=8, tools=[WEATHER], tool_choice={"type": "any"},
                    messages=ASK)
        with pytest.raises(anthropic.APIStatusError, match="without a tool call"):
            list(_create(qwen_server, max_tokens=8, tools=[WEATHER],
                         tool_choice={"type": "any"}, messages=ASK, stream=True))


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": ASK}, "field 'max_tokens': Field required"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "field 'temperature'"),
    ({"max_tokens": 4, "messages": []}, "field 'messages'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "field 'messages[0].content"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "Well"}]},
     "the last message must be the user's"),
    # The baby template renders no tools: the generic tool prompt outgrows the window.
    ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER]}, "field 'messages': the prompt has"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "needs 'tools'"),
    ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool"}},
     "field 'tool_choice.name': required when type is 'tool'"),
    ({"max_tokens": 300, "messages": ASK}, "exceeds the context window of 256 tokens"),
])
def test_errors_in_anthropic_shape(server: LiveServer, body: dict[str, Any],
                                   message: str) -> None:
    response = server.api.post("/v1/messages", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_client_errors_map_to_the_client_exceptions(server: LiveServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        server.anthropic().messages.create(model="other", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert denied.value.body == {"type": "error", "error": {  # type: ignore[comparison-overlap]
        "type": "authentication_error",
        "message": "missing or invalid API key: send 'x-api-key: <key>'"}}
    response = server.api.post("/v1/messages", content=b"{", headers={
        "content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert json.loads(response.text)["error"]["message"].startswith("request body is not valid")
    assert server.api.get("/health").json() == {"status": "ok"}
