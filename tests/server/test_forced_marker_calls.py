"""Forced tool calls (`required` / named) in formats whose call syntax has special tokens: Mistral
`[TOOL_CALLS]`, DeepSeek-V3 and V3.1. The opening tokens end the prompt and the random baby model
writes the rest under constrained decoding; the calls parse and match the function's schema."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from forced_tools import ASK, DESCRIBE, TAG, check_calls
from json_check import SCHEMAS
from live_server import MODEL, TEMPLATES, LiveServer, template_server
from scripted import scripted
from transformers import AutoTokenizer

from hetmoe.server.protocol import ChatMessage
from hetmoe.server.tool_grammar import arguments_regex
from hetmoe.server.tool_parsers import FORMATS
from hetmoe.server.tools import template_messages

NAMED = {"type": "function", "function": {"name": "describe"}}
TEMPLATE_OF = {"mistral": "mistral.jinja", "deepseek_v3": "deepseek_v3.jinja",
               "deepseek_v3_1": "deepseek_v3_1.jinja"}


@pytest.fixture(scope="module", params=sorted(TEMPLATE_OF))
def marker_server(request: pytest.FixtureRequest, tiny_qwen3_moe: Path,
                  tmp_path_factory: pytest.TempPathFactory,
                  one_torch_thread: None) -> Iterator[tuple[str, LiveServer]]:
    live = template_server(tiny_qwen3_moe, tmp_path_factory.mktemp(request.param),
                           TEMPLATE_OF[request.param], context=2048)
    yield request.param, live
    live.close()


def _chat(server: LiveServer, **options: Any) -> Any:
    return server.openai().chat.completions.create(model=MODEL, messages=ASK, **options)


def test_a_named_call_is_written_by_the_model(marker_server: tuple[str, LiveServer]) -> None:
    form, server = marker_server
    raw = server.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=[DESCRIBE, TAG], tool_choice=NAMED, temperature=0,
        max_tokens=120)
    assert raw.headers["x-hetmoe-tool-format"] == form
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    check_calls([call], {"describe"})
    chunks = list(_chat(server, tools=[DESCRIBE, TAG], tool_choice=NAMED, temperature=0,
                        max_tokens=120, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.id] == ["describe"]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no marker as text


def test_required_calls(marker_server: tuple[str, LiveServer]) -> None:
    form, server = marker_server
    options = dict(tools=[DESCRIBE, TAG], tool_choice="required", temperature=1.0, seed=3,
                   max_tokens=220)
    if form == "deepseek_v3_1":  # the name precedes a special token: a choice among several
        with scripted(server.service, "No call."):  # is not constrained; without a call: 422
            response = server.api.post("/v1/chat/completions",
                                       json={"model": MODEL, "messages": ASK, **options})
        assert response.status_code == 422 and "without a tool call" in response.text
        single = _chat(server, **{**options, "tools": [TAG]})  # one function: constrained
        check_calls(single.choices[0].message.tool_calls, {"tag.items-v2"})
        return
    reply = _chat(server, n=2, **options)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        check_calls(choice.message.tool_calls, {"describe", "tag.items-v2"})
        if form == "deepseek_v3":  # after one call the constrained reply can only end
            assert len(choice.message.tool_calls) == 1


def test_the_prompt_ends_with_the_opening_tokens(marker_server: tuple[str, LiveServer]) -> None:
    """A scripted reply after the prefix: parsed as the call, the prefix in the prompt."""
    form, server = marker_server
    written = {"mistral": ' [{"name": "describe", "arguments": {"name": "Ada"}}]',
               "deepseek_v3": 'describe\n```json\n{"name": "Ada"}\n```',
               "deepseek_v3_1": '{"name": "Ada"}'}[form]
    with scripted(server.service, written) as model:
        reply = _chat(server, tools=[DESCRIBE], tool_choice=NAMED)
    (call,) = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("describe",
                                                                         {"name": "Ada"})
    prompt = server.service.tokenizer.decode(model.prompts[0])
    opening = {"mistral": "[TOOL_CALLS]",
               "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
               "deepseek_v3_1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>describe<｜tool▁sep｜>"}
    assert prompt.endswith(opening[form])


@pytest.mark.parametrize("form", ["deepseek_v3", "deepseek_v3_1"])
def test_the_grammar_matches_what_the_template_writes(tiny_qwen3_moe: Path, form: str) -> None:
    """A call rendered by the real template is prefix + a reply the pattern allows + suffix."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    arguments = json.dumps({"name": "Ada", "age": 36, "color": "blue"})
    history = template_messages([ChatMessage(role="user", content=ASK[0]["content"]),
                                 ChatMessage.model_validate({
                                     "role": "assistant", "content": None, "tool_calls": [
                                         {"id": "c1", "type": "function", "function": {
                                             "name": "describe", "arguments": arguments}}]})],
                                text_arguments=form == "deepseek_v3_1")
    template = (TEMPLATES / TEMPLATE_OF[form]).read_text()
    render = tokenizer.apply_chat_template
    prompt = render(history[:1], tools=[DESCRIBE], chat_template=template, tokenize=False,
                    add_generation_prompt=True)
    full = render(history, tools=[DESCRIBE], chat_template=template, tokenize=False)
    reply = full[len(os.path.commonprefix([prompt, full])):].split("<｜end▁of▁sentence｜>")[0]
    reply = re.sub(r"\s*(<｜tool▁[^｜]+｜>)\s*", r"\1", reply)  # the template's indentation
    grammar = next(f for f in FORMATS if f.name == form).grammar
    assert grammar is not None
    forced = grammar([("describe", arguments_regex(SCHEMAS["person"], "describe"))], True)
    assert forced is not None and reply.startswith(forced.prefix)
    assert reply.endswith(forced.suffix)
    assert re.fullmatch(forced.pattern, reply[len(forced.prefix):len(reply) - len(forced.suffix)])
