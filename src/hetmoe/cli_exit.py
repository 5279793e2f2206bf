"""How a command ends on a user's error: one line on stderr and status 1 (`fail`), also when a
model cannot load (`load_llm`). Shared by cli.py and the cli_* command modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM


def fail(exc: BaseException) -> NoReturn:
    """Prints `error: ...` on stderr and exits with status 1."""
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=1)


def load_llm(model: str, device: str | None, rules: Path | None, **options: Any) -> LLM:
    """Loads a model for a command; user errors end the command with a one-line message."""
    from hetmoe.engine.engine import LLM  # here: `hetmoe --help` never imports torch

    try:
        return LLM(model, device=device, rules=rules, **options)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)
