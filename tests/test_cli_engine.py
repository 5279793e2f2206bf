"""The engine options of generate, chat and serve: one definition (cli_engine.EngineOptions),
the same options on every command, each value reaching `LLM`."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from hetmoe import cli
from hetmoe.cli_engine import EngineOptions

OPTIONS = ["--rules", "--device", "--dtype", "--max-seq-len", "--experts", "--deferred",
           "--defer-order", "--prefill-experts", "--gpu-expert-gib", "--chat-template", "--verbose"]


def assert_refused_before_loading(seen: dict[str, object], option: str, takes: str,
                                  bad_values: tuple[str, ...]) -> None:
    """`serve m OPTION BAD` exits 1 naming the option and what it takes, before `load_llm` (which
    fills `seen`) runs."""
    for bad in bad_values:
        seen.clear()
        done = CliRunner().invoke(cli.app, ["serve", "m", option, bad])
        assert done.exit_code == 1, done.output
        assert f"error: {option} takes {takes}, got {bad!r}" in done.output
        assert seen == {}  # refused before loading


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_model_command_takes_the_engine_options(command: str) -> None:
    text = CliRunner().invoke(cli.app, [command, "-h"]).output
    assert [f"--{f.name.replace('_', '-')}" for f in fields(EngineOptions)] == OPTIONS
    assert all(f"  {option} " in text or f" {option}  " in text for option in OPTIONS), text


def test_the_options_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def load(model: str, device: str | None, rules: object, **options: object) -> None:
        seen.update(model=model, device=device, rules=rules, **options)
        raise typer.Exit(0)  # loads nothing

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", load)
    done = CliRunner().invoke(cli.app, ["generate", "m", "hi", "--device", "cpu", "--dtype",
                                        "float32", "--max-seq-len", "64", "--experts", "torch",
                                        "--gpu-expert-gib", "0.5", "-v"])
    assert done.exit_code == 0, done.output
    assert seen == dict(model="m", device="cpu", rules=None, dtype="float32", max_seq_len=64,
                        experts="torch", deferred=0, defer_order="misses", prefill_experts="auto",
                        chat_template=None,
                        verbose=True, gpu_expert_bytes=2**29, lora=None)
    seen.clear()
    with pytest.raises(typer.Exit):  # a command's own keywords win
        EngineOptions().load("m", gpu_expert_bytes=7, max_batch=2)
    assert seen["gpu_expert_bytes"] == 7 and seen["max_batch"] == 2 and seen["dtype"] == "auto"
    done = CliRunner().invoke(cli.app, ["chat", "m", "--gpu-expert-gib", "lots"])
    assert done.exit_code == 1 and "--gpu-expert-gib takes auto or GiB >= 0, got 'lots'" in (
        done.output)


def test_deferred_takes_a_count_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def load(model: str, device: str | None, rules: object, **options: object) -> None:
        seen.update(options)
        raise typer.Exit(0)

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", load)
    for given, want in (("auto", "auto"), ("3", 3), ("0", 0)):
        done = CliRunner().invoke(cli.app, ["generate", "m", "hi", "--deferred", given])
        assert done.exit_code == 0 and seen["deferred"] == want, done.output
    assert_refused_before_loading(seen, "--deferred", "auto or an integer >= 0",
                                  ("two", "1.5", "-1", "Auto", ""))


def test_defer_order_is_checked_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def load(model: str, device: str | None, rules: object, **options: object) -> None:
        seen.update(options)
        raise typer.Exit(0)

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", load)
    done = CliRunner().invoke(cli.app, ["serve", "m", "--deferred", "3", "--defer-order",
                                        "misses"])
    assert done.exit_code == 0 and seen["defer_order"] == "misses", done.output
    seen.clear()
    done = CliRunner().invoke(cli.app, ["generate", "m", "hi", "--defer-order", "lowest"])
    assert done.exit_code == 1 and not seen
    assert "--defer-order takes score or misses, got 'lowest'" in done.output


def test_serve_max_batch_takes_a_count_or_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}
    fit = SimpleNamespace(auto_line=lambda: "KV slots: 3 (auto: ...)")

    def load(model: str, device: str | None, rules: object, **options: object) -> object:
        seen.update(options)
        return SimpleNamespace(deferral=None, kv_fit=fit if options["max_batch"] == "auto"
                               else None)

    def serve_app(*args: object) -> None:
        raise typer.Exit(0)  # serves nothing

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", load)
    monkeypatch.setattr("hetmoe.server.app.serve", serve_app)
    for given, want in ((["--max-batch", "auto"], "auto"), (["--max-batch", "32"], 32), ([], 8)):
        done = CliRunner().invoke(cli.app, ["serve", "m", *given])
        assert done.exit_code == 0 and seen["max_batch"] == want, done.output
        assert ("KV slots: 3 (auto: ...)" in done.output) == (want == "auto")  # its choice
    assert_refused_before_loading(seen, "--max-batch", "auto or an integer >= 1",
                                  ("0", "-1", "many", "1.5", "Auto"))
