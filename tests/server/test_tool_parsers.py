"""Tool-call parsing on what real chat templates (Qwen3, Mistral, DeepSeek-V3 and V3.1) write for
an assistant turn with calls: rendered, cut to the reply, parsed back to the same calls."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hetmoe.server.protocol import ChatMessage
from hetmoe.server.tool_parsers import FORMATS, ParsedOutput, ToolCall, detect
from hetmoe.server.tool_stream import CallArguments, CallStart, Delta, ToolStream
from hetmoe.server.tools import ToolPlan, template_messages

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALLS = (ToolCall("get_weather", '{"city": "Zürich"}'),
         ToolCall("get_time", '{"zone": "CET", "hours": 24}'))
# (template, format, end of the assistant's turn, arguments as JSON text)
FAMILIES = [
    ("qwen3.jinja", "qwen", "<|im_end|>", False),
    ("mistral.jinja", "mistral", "</s>", False),
    ("deepseek_v3.jinja", "deepseek_v3", "<｜end▁of▁sentence｜>", False),
    ("deepseek_v3_1.jinja", "deepseek_v3_1", "<｜end▁of▁sentence｜>", True),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_moe: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_qwen3_moe)


def _history(calls: tuple[ToolCall, ...]) -> list[ChatMessage]:
    return [
        ChatMessage(role="user", content="Weather and time in Zürich?"),
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call{i:05d}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]}),
    ]


def _reply(tokenizer: PreTrainedTokenizerBase, template: str, end: str, text_arguments: bool,
           calls: tuple[ToolCall, ...] = CALLS) -> str:
    """What the template writes for the assistant's turn with `calls`, up to its end token."""
    history = template_messages(_history(calls), text_arguments)
    render = tokenizer.apply_chat_template
    prompt = render(history[:1], tools=[WEATHER, TIME], chat_template=template, tokenize=False,
                    add_generation_prompt=True)
    full = render(history, tools=[WEATHER, TIME], chat_template=template, tokenize=False)
    reply = full[len(os.path.commonprefix([prompt, full])):]
    assert "Weather and time" not in reply  # the reply alone
    return reply.split(end)[0]


def _plan(form_name: str, parallel: bool = True) -> ToolPlan:
    form = next(f for f in FORMATS if f.name == form_name)
    return ToolPlan(form, [WEATHER, TIME], "auto", parallel)


def _stream(plan: ToolPlan, text: str, size: int = 3,
            ) -> tuple[str, list[ToolCall], list[list[Delta]], ParsedOutput | None]:
    """`text` fed to a ToolStream in pieces of `size` characters: (content, calls assembled
    from their deltas, the deltas of each piece and then of the finish, the parse)."""
    stream = ToolStream(plan)
    steps = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)]
    rest, parsed = stream.finish()
    steps.append(rest)
    content, names, arguments = "", {}, {}
    for delta in (d for step in steps for d in step):
        if isinstance(delta, str):
            content += delta
        elif isinstance(delta, CallStart):
            assert delta.index == len(names) and delta.id
            names[delta.index], arguments[delta.index] = delta.name, ""
        else:
            arguments[delta.index] += delta.text
    calls = [ToolCall(names[i], arguments[i]) for i in sorted(names)]
    return content, calls, steps, parsed


@pytest.mark.parametrize(("name", "form", "end", "text_arguments"), FAMILIES)
def test_real_template_calls_parse_back(tokenizer: PreTrainedTokenizerBase, name: str, form: str,
                                        end: str, text_arguments: bool) -> None:
    template = (TEMPLATES / name).read_text()
    assert detect(template) is not None and detect(template).name == form  # type: ignore[union-attr]
    reply = _reply(tokenizer, template, end, text_arguments)
    parsed = _plan(form).parse(reply)
    assert parsed is not None, reply
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == \
        [(c.name, json.loads(c.arguments)) for c in CALLS]
    assert parsed.content.strip() in ("", "<think>\n\n</think>")  # Qwen3 writes an empty think
    # Streamed in pieces of 3 characters: the same content and calls.
    content, calls, steps, streamed = _stream(_plan(form), reply)
    assert streamed == parsed and content == parsed.content and tuple(calls) == parsed.calls
    pieces = [[d for d in step if isinstance(d, CallArguments)] for step in steps]
    if form == "qwen":  # arguments as they are generated, a piece per fed piece
        assert sum(1 for step in pieces[:-1] if step) >= len(CALLS[0].arguments) // 3
        assert not pieces[-1]
    else:  # whole calls when the answer ends
        assert not any(pieces[:-1]) and len(pieces[-1]) == len(CALLS)
    single = _plan(form, parallel=False)
    assert single.parse(reply).calls == parsed.calls[:1]  # type: ignore[union-attr]
    assert _stream(single, reply)[1] == list(parsed.calls[:1])


@pytest.mark.parametrize(("name", "form", "end", "text_arguments"), FAMILIES)
def test_broken_calls_stay_text(tokenizer: PreTrainedTokenizerBase, name: str, form: str,
                                end: str, text_arguments: bool) -> None:
    template = (TEMPLATES / name).read_text()
    reply = _reply(tokenizer, template, end, text_arguments)
    cut = reply[: reply.rindex("}") - 2]  # generation stopped inside the arguments
    assert _plan(form).parse(cut) is None
    content, calls, _, parsed = _stream(_plan(form), cut)
    assert parsed is None
    if form == "qwen":  # the calls streamed as far as they got, as OpenAI streams them
        assert content == cut[:cut.index("<tool_call>")]
        assert [c.name for c in calls] == [c.name for c in CALLS]
        assert calls[0] == CALLS[0] and CALLS[1].arguments.startswith(calls[1].arguments)
    else:  # nothing streamed before the end: the text
        assert (content, calls) == (cut, [])
    unknown = _reply(tokenizer, template, end, text_arguments,
                     (ToolCall("delete_files", '{"path": "/"}'),))
    assert _plan(form).parse(unknown) is None  # a function that was not offered
    array = _reply(tokenizer, template, end, text_arguments, (ToolCall("get_time", "[1, 2]"),))
    assert _plan(form).parse(array) is None  # arguments must be an object


def test_plain_text_streams_whole_and_marker_prefixes_are_held() -> None:
    stream = ToolStream(_plan("qwen"))
    assert stream.feed("a < b and <tool") == ["a < b and "]
    assert stream.feed("s> are fine") == ["<tools> are fine"]
    assert stream.finish() == ([], None)
    assert _plan("qwen").parse("no calls here") is None


def test_mistral_v11_calls_and_ids() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}[TOOL_CALLS]get_time[ARGS]{}'
    parsed = _plan("mistral").parse(text)
    assert parsed is not None
    assert parsed.calls == (ToolCall("get_weather", '{"city": "Bern"}'), ToolCall("get_time", "{}"))
    ids = _plan("mistral").ids(3)
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 3
    assert _plan("qwen").ids(1)[0].startswith("call_")


def test_detect_names_no_format_for_other_templates() -> None:
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_decoding_keeps_the_special_tokens_of_the_call_syntax(tiny_qwen3_moe: Path) -> None:
    """Mistral's [TOOL_CALLS] is a special token, which decoding would skip."""
    import threading
    from types import SimpleNamespace

    from hetmoe.server.service import ModelService

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    service = ModelService.__new__(ModelService)  # only the tokenizer side
    service.tokenizer = tokenizer
    service.llm = SimpleNamespace(  # type: ignore[assignment]
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    service._tokenizer_lock = threading.Lock()
    service._kept_ids = service._marker_ids(next(f for f in FORMATS if f.name == "mistral"))
    assert service._kept_ids == {marker: "[TOOL_CALLS]"}
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), marker,
           *tokenizer.encode(' [{"name": "get_time", "arguments": {}}]', add_special_tokens=False),
           tokenizer.eos_token_id]
    text = service._decode(ids)
    assert text == 'Hi[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'
    assert _plan("mistral").parse(text).calls == (ToolCall("get_time", "{}"),)  # type: ignore[union-attr]
