"""A tool-call round trip on the real demo model (SmolLM2-135M-Instruct as a MoE) through the
official `openai` client against `hetmoe serve` on 127.0.0.1: the named tool_choice makes the
model write a call whose arguments match the schema (constrained decoding), the client runs a
scripted Python function, sends its result as a tool message, and the model answers in text.

SmolLM2's own chat template renders no tools (the server refuses `tools` with it), so the test
serves the demo checkpoint with Qwen3's template (tests/server/templates/qwen3.jinja): ChatML, on
the same <|im_start|> / <|im_end|> tokens SmolLM2 was trained on, with the `<tool_call>` format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from served import serve

QWEN3_TEMPLATE = Path(__file__).parents[1] / "server" / "templates" / "qwen3.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def get_weather(city: str, unit: str) -> dict[str, Any]:
    """The scripted tool."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit,
            "sky": "sunny"}


@pytest.fixture(scope="module")
def client(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    """The official client against `hetmoe serve` on the demo checkpoint with Qwen3's
    template."""
    tmp = tmp_path_factory.mktemp("demo-tools")
    model = tmp / "demo-qwen3-template"
    model.mkdir()
    for file in demo_dir.iterdir():
        if file.name != "chat_template.jinja":
            (model / file.name).symlink_to(file)
    shutil.copy(QWEN3_TEMPLATE, model / "chat_template.jinja")
    flags = ("--model-name", "demo", "--device", "cpu", "--max-batch", "2",
             "--max-seq-len", "1024")
    with serve(str(model), tmp / "serve.log", *flags) as url:
        with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as openai:
            yield openai


def test_round_trip_with_a_scripted_tool(client: OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER],
                                           tool_choice=named, temperature=0, max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert isinstance(arguments["city"], str) and 0 < len(arguments["city"]) <= 24
    result = get_weather(**arguments)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    answer = client.chat.completions.create(model="demo", messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=128)
    final = answer.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert final.message.content
    # The second turn's prompt is the first's plus the call and the tool's answer.
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1
