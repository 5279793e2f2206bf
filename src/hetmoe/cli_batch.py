"""`hetmoe batch IN.jsonl OUT.jsonl`: an offline job in the OpenAI Batch format.

Every line is answered by the server's own routes in this process (so its outputs are what the
API answers the same request), all submitted together to one scheduler so they batch; the job
itself (lines, resuming, result files) is engine/requests/batch_job.py, its KV cache sized from
its lines (cli_batch_sizing.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hetmoe.cli_engine import EngineOptions, engine_options
from hetmoe.cli_exit import fail
from hetmoe.config import EngineConfig
from hetmoe.server.config import ServerConfig

# Commands import what they run inside their functions: `hetmoe --help` imports none of torch,
# transformers, rich, httpx, the engine or the loaders (tests/test_cli_basics.py).

if TYPE_CHECKING:
    from hetmoe.cli_batch_sizing import JobSizing
    from hetmoe.engine.engine import LLM
    from hetmoe.engine.requests.batch_job import JobFiles, JobLine, LineError

_DEFAULTS = EngineConfig()
IN_FLIGHT = 4096
"""Requests handed to the scheduler at once at most (each holds its prompt and state)."""
SERVER_FAILURES_EXIT = 3
"""Exit status of a job in which requests failed on the server (1: a user error, `fail`)."""
MAX_BATCH_HELP = (
    "KV slots, sequences decoded together: auto = the job's sequences (prompts x n of the lines "
    "to run), at most the slots whose KV cache fits the memory the weights leave, at most 256; "
    "or a number. On a GPU the KV cache takes the room --gpu-expert-gib auto would take, so it "
    "comes first and auto experts get what it leaves (rows decoded together raise a job's "
    "throughput, as each decode step reads an expert once for all its rows; a resident expert "
    "saves only its share of the CPU's reads); --gpu-expert-gib N is set aside before it. 256: "
    "the batch the throughput benchmark measures; there a top-8-of-128 layer routes 16 tokens "
    "per expert, a full AMX tile, so more rows add compute more than throughput")
MAX_SEQ_LEN_HELP = (
    "Context window per sequence: auto = the longest line's prompt (as the chat template "
    "renders it) + max_tokens (none: generates to the window's end, in the default window of "
    "the model's context capped at 4096, or its prompt + 1 if longer), rounded up to a "
    "multiple of 256, capped at the model's context; or a number. A longer line gets "
    "its 400 in the error file")


@engine_options
def batch(
    input: Annotated[Path, typer.Argument(help="Requests, one JSON object a line (OpenAI Batch "
                                               "input: custom_id, method, url, body)")],
    output: Annotated[Path, typer.Argument(help="Results (OpenAI Batch output); a rerun "
                                                "skips the requests answered in it or the "
                                                "error file, but runs again those that failed "
                                                "on the server (status >= 500)")],
    model: Annotated[str | None, typer.Option(
        help="Model to load (default: the `model` of the first request)")] = None,
    errors: Annotated[Path | None, typer.Option(
        help="Errors per line and failed requests (default: OUTPUT with .errors.jsonl)")] = None,
    max_batch: Annotated[str, typer.Option(help=MAX_BATCH_HELP)] = "auto",
    max_seq_len: Annotated[str, typer.Option(help=MAX_SEQ_LEN_HELP)] = "auto",
    prefill_chunk: Annotated[int, typer.Option(
        help="Prompt tokens prefilled per step (0 = no limit)")] = _DEFAULTS.prefill_chunk or 0,
    placement_sample: Annotated[int, typer.Option(
        help="Prompts of the job (evenly spaced) prefilled first to count the experts they "
             "route to; the most routed go resident under --gpu-expert-gib (0 = no sample: the "
             "first experts of each layer)")] = 0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress",
                                           help="Show the progress bar")] = True,
    *,
    engine: EngineOptions,
) -> None:
    """Answer a file of OpenAI Batch requests offline (resumable).

    Results are written as requests end; a job killed midway continues where it stopped when
    run again with the same files. A rerun also tries again the requests that failed on the
    server (status >= 500: an engine fault, an internal error, a timeout), their old records
    taken out of the error file; a 4xx (the request's own fault) and an invalid line are final.
    The KV cache is sized from the job before the weights load (--max-batch, --max-seq-len), in
    one line that says slots x window, GiB and where. Nothing is written before the job runs: a
    command that stops sooner leaves both files as they were.

    Exit status: 0 when every request ran (a 4xx or an invalid line included), 1 on a user
    error, 3 when requests failed on the server in this run (rerun the same command to try
    them again).
    """
    from hetmoe.engine.requests.batch_job import JobFiles, JobLine, LineError, read_lines

    slots, window = _count("--max-batch", max_batch), _count("--max-seq-len", max_seq_len)
    if not input.is_file():
        fail(FileNotFoundError(f"input file {input} does not exist"))
    budget = _expert_budget(engine, placement_sample)
    errors = errors or output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")
    try:
        lines = list(read_lines(input))
        files = JobFiles(output, errors)
    except (ValueError, UnicodeDecodeError) as exc:
        fail(exc)
    todo = [line for line in lines if isinstance(line, JobLine) and not files.finished(line)]
    invalid = [line for line in lines if isinstance(line, LineError) and not files.finished(line)]
    for bad in invalid:
        typer.echo(f"{input}: line {bad.number}: {bad.reason}", err=True)
    if not todo:
        _record(files, invalid, (), [])
        files.close()
        typer.echo(f"nothing to run: the {len(lines)} lines of {input} are answered or invalid")
        return
    name = model or next((str(line.body["model"]) for line in todo if "model" in line.body), None)
    if name is None:
        fail(ValueError("no model to load: pass --model or name it in the requests' `model`"))
    todo, sizing = _sized(input, name, todo, engine, (slots, window), progress)
    if not todo:
        _record(files, invalid, sizing.too_long, [])
        files.close()
        typer.echo(f"nothing to run: every line left is longer than the window (errors: {errors})")
        return
    # With a sample the experts are placed once, by its counts (not first at load).
    more = {"gpu_expert_bytes": 0} if placement_sample else {}
    llm = engine.load(name, max_batch=sizing.fit.slots, max_seq_len=sizing.fit.window,
                      prefill_chunk=prefill_chunk or None, progress=progress, **more)
    if placement_sample:
        _preplace(llm, todo, placement_sample, budget)
    _record(files, invalid, sizing.too_long, todo)
    try:
        asyncio.run(_serve(llm, name, todo, files, progress))
    finally:
        files.close()
    _ended(len(todo), files.server_failures, output, errors)


def _count(option: str, value: str) -> int | None:
    """An `auto`-or-count option: None for auto, else the positive integer."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        fail(ValueError(f"{option} takes auto or an integer >= 1, got {value!r}"))
    return int(value)


def _expert_budget(engine: EngineOptions, placement_sample: int) -> int | str:
    """`--gpu-expert-gib` as bytes (or auto), checked against `--placement-sample`."""
    budget = engine.expert_bytes()
    if placement_sample < 0:
        fail(ValueError(f"--placement-sample must be >= 0 prompts, got {placement_sample}"))
    if placement_sample and budget == 0:
        fail(ValueError("--placement-sample needs a GPU expert budget to place experts in "
                        "(--gpu-expert-gib > 0 or auto), got --gpu-expert-gib 0"))
    return budget


def _record(files: JobFiles, invalid: list[LineError],
            too_long: Sequence[tuple[JobLine, str, str]], todo: list[JobLine]) -> None:
    """Writes what is known before the job runs (the invalid lines, the lines longer than the
    window: their 400), then takes out of the error file the server-side failures among `todo`
    and those these records supersede (`JobFiles.retry`), and says how many are tried again.
    Called only once nothing but the job itself is left to fail."""
    try:
        for bad in invalid:
            files.error(bad)
        for line, field, message in too_long:
            files.result(line, 400, {"error": {"message": message, "param": field,
                                               "type": "invalid_request_error", "code": None}})
        again = files.retry(todo)
    except OSError as exc:
        files.close()
        fail(exc)
    if again:
        subject, them = _lines(again)
        typer.echo(f"{subject} failed on the server last time: trying {them} again", err=True)


def _ended(run: int, failures: int, output: Path, errors: Path) -> None:
    """Says what the job did; requests that failed on the server end the command with
    `SERVER_FAILURES_EXIT`, so a script knows to run it again."""
    typer.echo(f"{run - failures} requests answered into {output} (errors: {errors})")
    if failures:
        subject, them = _lines(failures)
        typer.echo(f"{subject} failed on the server: rerun the same command to try {them} again",
                   err=True)
        raise typer.Exit(code=SERVER_FAILURES_EXIT)


def _lines(count: int) -> tuple[str, str]:
    """("1 line", "it") or ("N lines", "them")."""
    return ("1 line", "it") if count == 1 else (f"{count} lines", "them")


def _sized(input: Path, model: str, todo: list[JobLine], engine: EngineOptions,
           asked: tuple[int | None, int | None],
           progress: bool) -> tuple[list[JobLine], JobSizing]:
    """The job's KV cache (cli_batch_sizing.py), printed before the weights load, and the lines
    of `todo` it can run: those longer than its window are named and left out (their 400s are
    written when the job runs)."""
    from hetmoe.cli_batch_sizing import size_job

    try:
        sizing = size_job(model, todo, engine, *asked, progress)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)
    for line, _, message in sizing.too_long:
        typer.echo(f"{input}: line {line.number}: {message}", err=True)
    typer.echo(sizing.describe(), err=True)
    refused = {line.number for line, _, _ in sizing.too_long}
    return [line for line in todo if line.number not in refused], sizing


def _preplace(llm: LLM, todo: list[JobLine], sample: int, budget: int | str) -> None:
    """Places the experts a sample of the job routes to most (engine/preplacement.py)."""
    from hetmoe.engine.preplacement import preplace

    try:
        done = preplace(llm, todo, sample, budget)
    except ValueError as exc:
        fail(exc)
    typer.echo(done.describe(), err=True)


async def _serve(llm: LLM, name: str, todo: list[JobLine], files: JobFiles,
                 show: bool) -> None:
    """Answers `todo` through the API's routes over an in-process ASGI transport."""
    import httpx
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from hetmoe.engine.requests.batch_job import run_job
    from hetmoe.server.app import build_app
    from hetmoe.server.service import ModelService

    service = ModelService(llm, name, max_queue=2**31)  # the job's own requests only
    local = ServerConfig(max_body_bytes=1 << 30)  # lines of a local file: no web-sized limit
    # An unexpected error is the route's 500 in the error file, not the job's end.
    transport = httpx.ASGITransport(app=build_app(service, local), raise_app_exceptions=False)
    bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[rate]} tok/s"), TimeElapsedColumn(),
                       TextColumn("ETA"), TimeRemainingColumn(), disable=not show)
    task = bar.add_task("batch", total=len(todo), rate="0.0")
    started, tokens = time.perf_counter(), 0

    def on_result(completion_tokens: int) -> None:
        nonlocal tokens
        tokens += completion_tokens
        rate = tokens / max(time.perf_counter() - started, 1e-9)
        bar.update(task, advance=1, rate=f"{rate:.1f}")

    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                 timeout=None) as client:

        async def answer(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            response = await client.post(url, json={"model": name, **body})
            try:
                return response.status_code, dict(response.json())
            except json.JSONDecodeError:
                return response.status_code, {"error": {"message": response.text}}

        try:
            with bar:
                await run_job(todo, files, answer, on_result, IN_FLIGHT)
        finally:
            service.close()
