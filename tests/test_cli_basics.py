"""The CLI's own face: -h, --version, metavars and summaries that read whole, a fast --help."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hetmoe import __version__
from hetmoe.cli import app

COMMANDS = ("generate", "chat", "serve", "bench", "calibrate", "convert", "info", "sft", "batch",
            "pull", "ls", "rm")


def _help(*args: str) -> str:
    result = CliRunner().invoke(app, [*args], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def test_version() -> None:
    assert _help("--version") == f"hetmoe {__version__}\n"


@pytest.mark.parametrize("command", [(), *((c,) for c in COMMANDS)])
def test_h_is_help_and_no_metavar_shows_a_python_type(command: tuple[str, ...]) -> None:
    text = _help(*command, "-h")
    assert text == _help(*command, "--help")
    assert "-h, --help" in text
    assert "list[" not in text


def test_stop_reads_as_text() -> None:
    assert "--stop TEXT " in _help("generate", "-h")


def test_command_summaries_are_whole_sentences() -> None:
    listed = _help("-h").split("Commands:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == list(COMMANDS)
    for line in listed:
        assert line.endswith(".") and not line.endswith("..."), line
    assert ("  info       Print this machine's facts and rates, or MODEL's memory plan."
            in listed)


def test_help_imports_no_torch_rich_httpx_or_engine() -> None:
    code = ("import sys\nfrom hetmoe.cli import app\ntry:\n    app(['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'rich', 'httpx', 'hetmoe.engine',"
            " 'hetmoe.loading') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
