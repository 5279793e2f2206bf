"""`hetmoe pull`, `hetmoe ls`, `hetmoe rm`: Hub models in the local cache (cli.py registers
these commands)."""

from __future__ import annotations

from typing import Annotated

import typer

from hetmoe.cli_convert import ExpertFormatOpt, GroupOpt
from hetmoe.cli_exit import fail

# Commands import what they run inside their functions: `hetmoe --help` imports none of torch,
# transformers, rich, httpx, the engine or the loaders (tests/test_cli_basics.py).

HubNameArg = Annotated[str, typer.Argument(
    help="Hub model: org/name[@revision] (safetensors) or org/name-GGUF[:QUANT]")]
TokenOpt = Annotated[str | None, typer.Option(
    help="Hugging Face token for gated or private repos (default: HF_TOKEN or `hf auth login`)")]


def pull(
    name: HubNameArg,
    experts: ExpertFormatOpt = None,
    group: GroupOpt = None,
    token: TokenOpt = None,
    convert: Annotated[bool, typer.Option(
        "--convert/--no-convert", help="Also make the converted layout the engine maps")] = True,
) -> None:
    """Download NAME (and convert it) ahead of time.

    Asks the Hub for the newest commit of the revision (a newer one is fetched and converted
    again); only the model's files are downloaded, into the Hugging Face cache, resumable.
    Later commands load NAME from the cache without a request.
    """
    from hetmoe.loading.hub import fetch_model
    from hetmoe.loading.hub_cache import hub_conversion
    from hetmoe.loading.hub_names import parse_hub_name

    hub_name = parse_hub_name(name)
    if hub_name is None:
        fail(ValueError(f"{name!r} is not a Hub model name (org/name[@revision][:QUANT])"))
    try:
        model = fetch_model(hub_name, token, refresh=True)
        typer.echo(f"{model.name}: commit {model.commit} in {model.snapshot}")
        if convert:
            out = hub_conversion(model, experts, group)
            typer.echo(f"{model.name}: converted layout {out}")
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)


def ls() -> None:
    """List cached Hub models: name, revision, format, size on disk."""
    from rich.console import Console
    from rich.table import Table

    from hetmoe.loading.hub_cache import entries

    rows = entries()
    if not rows:
        typer.echo("no Hub models in the cache (`hetmoe pull NAME` fetches one)")
        return
    table = Table("name", "revision", "format", "size", "path", title="cached Hub models")
    for row in rows:
        table.add_row(row.name, row.commit[:12], row.layout, human_bytes(row.size),
                      str(row.path))
    Console(width=200).print(table)


def human_bytes(size: int) -> str:
    """`size` in B, KB, MB, GB or TB (powers of 1000, as the Hub shows them)."""
    value, unit = float(size), "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def rm(name: HubNameArg) -> None:
    """Remove a cached Hub model: its files, record and converted layouts.

    org/name removes every revision and quant of the repo; @revision or :QUANT narrow it.
    """
    from hetmoe.loading.hub_cache import remove

    try:
        for removed in remove(name):
            typer.echo(f"removed {removed}")
    except (ValueError, FileNotFoundError) as exc:
        fail(exc)
