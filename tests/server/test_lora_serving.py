"""`hetmoe serve --lora NAME=PATH`: a request picks an adapter by naming it as its `model`; the
base model keeps its own name; an unknown name is a 404; /v1/models lists all of them. The
served adapter answers as `LLM(lora=...)` does (which equals PEFT + transformers:
tests/train/test_persona.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import API_KEY, MODEL, LiveServer
from persona import NAME, QUESTION, persona_llm

from hetmoe.server.config import ServerConfig


@pytest.fixture(scope="module")
def server(persona_adapter: tuple[Path, Path], one_torch_thread: None) -> Iterator[LiveServer]:
    base, path = persona_adapter
    live = LiveServer(persona_llm(base, lora={"persona": path}), ServerConfig(api_key=API_KEY))
    yield live
    live.close()


def _ask(server: LiveServer, model: str) -> str:
    reply = server.openai().chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def test_a_request_selects_the_adapter_by_model_name(server: LiveServer,
                                                     persona_adapter: tuple[Path, Path]) -> None:
    tuned = _ask(server, "persona")
    assert NAME in tuned
    base, path = persona_adapter
    assert tuned == persona_llm(base, lora=path).chat(QUESTION, max_new_tokens=16).text
    assert NAME not in _ask(server, MODEL)  # the base model, by its own name
    listed = [m.id for m in server.openai().models.list().data]
    assert listed == [MODEL, "persona"]


def test_an_unknown_model_name_is_a_404_naming_what_is_served(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError, match="'tiny-moe', 'persona'"):
        _ask(server, "nobody")


def test_lora_option_is_checked_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from hetmoe import cli

    seen: dict[str, object] = {}
    monkeypatch.setattr("hetmoe.cli_engine.load_llm",
                        lambda model, device, rules, **o: seen.update(o))
    monkeypatch.setattr("hetmoe.server.app.serve", lambda llm, name, config: None)
    runner = CliRunner()
    done = runner.invoke(cli.app, ["serve", "m", "--lora", "a=/x", "--lora", "b=/y"])
    assert done.exit_code == 0, done.output
    assert seen["lora"] == {"a": "/x", "b": "/y"}
    for bad, message in (("nopath", "--lora takes NAME=PATH"), ("m=/z", "already the name")):
        seen.clear()
        done = runner.invoke(cli.app, ["serve", "m", "--lora", bad])
        assert done.exit_code == 1 and message in done.output and seen == {}
