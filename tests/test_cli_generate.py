"""The command line, in-process: generate and chat on a preset, info, and user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe._cpu import cpu_features
from hetmoe.cli import app

runner = CliRunner()


@pytest.fixture()
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache shared by this module's tests (presets build once)."""
    path = tmp_path_factory.getbasetemp() / "cli-cache"
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(path))
    return path


def test_generate_streams_the_engines_chat_answer(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hello", "--max-new-tokens", "8",
                                 "--verbose"])
    assert result.exit_code == 0, result.output
    llm = LLM("tiny-qwen3-moe", progress=False)
    expected = llm.chat([{"role": "user", "content": "Hello"}], max_new_tokens=8).text
    assert result.stdout.endswith(expected + "\n")
    assert "injection: 4 module(s) replaced" in result.stdout
    assert "model.layers.1.mlp: Qwen3MoeSparseMoeBlock -> hybrid_moe on cpu (rule 1)" in (
        result.stdout
    )
    assert (cache / "models").is_dir()


def test_generate_raw_continues_the_text(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hello", "--max-new-tokens", "8",
                                 "--raw"])
    assert result.exit_code == 0, result.output
    expected = LLM("tiny-qwen3-moe", progress=False).generate("Hello", max_new_tokens=8).text
    assert result.stdout.endswith(expected + "\n")


def test_chat_keeps_history_and_exits(cache: Path) -> None:
    result = runner.invoke(app, ["chat", "tiny-mixtral", "--max-new-tokens", "6"],
                           input="Hi there\n\nHow are you?\n/exit\nnever read\n")
    assert result.exit_code == 0, result.output
    llm = LLM("tiny-mixtral", progress=False)
    first = [{"role": "user", "content": "Hi there"}]
    reply = llm.chat(first, max_new_tokens=6).text
    second = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "How are you?"}]
    assert reply + "\n" in result.stdout
    assert llm.chat(second, max_new_tokens=6).text + "\n" in result.stdout
    assert "never read" not in result.stdout


def test_unknown_model_is_a_one_line_error(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "no-such-model", "Hi"])
    assert result.exit_code == 1
    assert "error: model 'no-such-model' is neither an existing directory nor a built-in" in (
        result.output
    )


def test_rule_file_errors_reach_the_user(cache: Path, tmp_path: Path) -> None:
    rules = tmp_path / "bad.yaml"
    rules.write_text("- match: {class: X}\n  replace: {op: warp_drive}\n")
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hi", "--rules", str(rules)])
    assert result.exit_code == 1
    assert f"error: {rules}: rule 0, field replace.op: unknown op 'warp_drive'" in result.output


def test_info_prints_the_machine_report() -> None:
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    keys = [line.split()[0] for line in result.stdout.splitlines()]
    assert keys[:7] == ["hetmoe", "python", "cpu", "cores", "isa", "amx", "numa"]
    assert "torch" in keys
    amx = next(line for line in result.stdout.splitlines() if line.startswith("amx"))
    has_amx = cpu_features()["amx_tile"]
    assert ("not in this CPU" in amx) != has_amx, amx


@pytest.mark.parametrize("command", [[], ["generate"], ["bench"], ["serve"], ["chat"], ["info"]])
def test_help_shows_no_internal_notes_or_flag_types(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], prog_name="hetmoe")
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "as it lands" not in result.output
    assert "Usage: hetmoe" in result.output
    if command == ["generate"]:
        assert "demo, demo-sparse" in result.output and "--raw " in result.output


def test_deferral_without_a_gpu_is_refused(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hi", "--device", "cpu",
                                 "--deferred", "2"])
    assert result.exit_code == 1
    assert "error: option deferred=2 needs GPU decode" in result.output


def test_deferred_auto_says_what_it_chose_at_start(cache: Path) -> None:
    from hetmoe.engine.model.deferral_auto import NO_GPU

    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hi", "--device", "cpu",
                                 "--deferred", "auto", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert f"deferred auto: 0 ({NO_GPU})\n" in result.stderr


def test_gpu_prefill_on_a_cpu_run_is_refused_before_loading(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hi", "--device", "cpu",
                                 "--prefill-experts", "split"])
    assert result.exit_code == 1
    assert ("option prefill_experts='split' computes experts on a GPU; this run is on cpu "
            "(use 'auto' or 'cpu')") in result.output


def test_prefill_experts_option_is_checked(cache: Path) -> None:
    result = runner.invoke(app, ["generate", "tiny-qwen3-moe", "Hi", "--prefill-experts", "tpu"])
    assert result.exit_code == 1
    assert "option prefill_experts must be one of auto, cpu, gpu, split, got 'tpu'" in (
        result.output)


@pytest.mark.parametrize(("option", "message"), [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-k", "-3"], "top_k must be >= 0, got -3"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--device", "tpu"], "device 'tpu' is not a device name torch knows"),
])
def test_bad_options_fail_before_loading(option: list[str], message: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was resolved before the options were checked")

    monkeypatch.setattr("hetmoe.presets.resolve_model", never)
    for command in ("generate", "chat"):
        args = [command, "tiny-qwen3-moe", *(["Hi"] if command == "generate" else []), *option]
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        assert f"error: {message}" in result.output


def test_ctrl_c_stops_the_answer_not_the_chat(cache: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    echo = typer.echo
    calls = []

    def interrupted_once(message: object = None, *args: object, **kwargs: object) -> None:
        calls.append(message)
        if len(calls) == 2:  # the first piece of the first answer: Ctrl-C arrives
            raise KeyboardInterrupt
        echo(message, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(typer, "echo", interrupted_once)
    result = runner.invoke(app, ["chat", "tiny-mixtral", "--max-new-tokens", "6"],
                           input="Hi there\nHow are you?\n/exit\n")
    assert result.exit_code == 0, result.output
    assert " [stopped]" in result.stdout
    # The session went on, the cut answer (nothing shown of it) kept in the history.
    llm = LLM("tiny-mixtral", progress=False)
    second = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": ""},
              {"role": "user", "content": "How are you?"}]
    assert llm.chat(second, max_new_tokens=6).text + "\n" in result.stdout
