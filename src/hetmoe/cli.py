"""Command line: generate, chat, info (serve, bench and convert join as they land)."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


@app.callback()
def main() -> None:
    """hetmoe: MoE LLMs on one workstation, GPU and CPU as one machine."""


@app.command()
def info() -> None:
    """Print the machine report: CPU, ISA (AMX and its OS permission), NUMA, GPU, versions."""
    from hetmoe.machine import machine_report

    for key, value in machine_report().items():
        typer.echo(f"{key:<16} {value}")


if __name__ == "__main__":
    app()
