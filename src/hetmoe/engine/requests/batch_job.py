"""An offline job in the OpenAI Batch format: input lines in, one result line per request out.

Input (JSONL): one request per line, `{"custom_id", "method": "POST", "url", "body"}` with `url`
one of `URLS`; a line that is not such an object (or repeats a `custom_id`) is a `LineError`
(line number and reason) and the job goes on. Every request is handed to `answer` (the API's
handler, given by the caller) at once, up to `in_flight`, so the scheduler batches them.

Output, OpenAI's Batch output format: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error": null}` in OUT for status 200; other statuses and line errors
(`"response": null, "error": {"code", "message", "line"}`) go to the error file. Each line is
written and flushed as its request ends, so a killed job loses only requests in flight: a rerun
reads both files (a last line cut short is dropped) and skips every `custom_id` and line number
already there, except requests that failed on the server (`response.status_code` >= 500: an
engine fault, an internal error, a timeout), which it runs again after taking their records out
of the error file (`JobFiles.retry`, atomically, right before the job runs). Either way each
request ends up in the files exactly once; a 4xx (the request's own fault) and an invalid line are
final, and supersede a failure of the same custom_id (an edited line), whose record goes too.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

URLS = ("/v1/chat/completions", "/v1/completions")
"""Routes a line may name."""

Answer = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
"""(url, body) -> (HTTP status, response body): one request served."""


@dataclass(frozen=True)
class JobLine:
    """One well-formed input line."""

    number: int
    """1-based line number in the input file."""
    custom_id: str
    """The caller's id of the request, unique in the file."""
    url: str
    """One of `URLS`."""
    body: dict[str, Any]
    """The request body, as for the API."""


@dataclass(frozen=True)
class LineError:
    """An input line that cannot be run, and why."""

    number: int
    """1-based line number in the input file."""
    custom_id: str | None
    """Its `custom_id` when one could be read."""
    reason: str
    """What is wrong with it."""


def read_lines(path: Path) -> Iterator[JobLine | LineError]:
    """The input's lines, parsed and checked (blank lines skipped)."""
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                line = _parse(number, text)
                if isinstance(line, JobLine):
                    if line.custom_id in seen:
                        line = LineError(number, line.custom_id, f"custom_id {line.custom_id!r} "
                                         f"repeats line {seen[line.custom_id]}")
                    else:
                        seen[line.custom_id] = number
                yield line


def _parse(number: int, text: str) -> JobLine | LineError:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return LineError(number, None, f"not JSON: {exc}")
    if not isinstance(item, dict):
        return LineError(number, None, f"expected a JSON object, got {type(item).__name__}")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, None, "field 'custom_id' must be a non-empty string")
    method, url, body = item.get("method"), item.get("url"), item.get("body")
    reason = None
    if method != "POST":
        reason = f"field 'method' must be \"POST\", got {method!r}"
    elif url not in URLS:
        reason = f"field 'url' must be one of {', '.join(URLS)}, got {url!r}"
    elif not isinstance(body, dict):
        reason = "field 'body' must be a JSON object"
    elif body.get("stream"):
        reason = "field 'body.stream': a batch request is answered whole, not streamed"
    if reason is not None:
        return LineError(number, custom_id, reason)
    assert isinstance(url, str) and isinstance(body, dict)
    return JobLine(number, custom_id, url, body)


class JobFiles:
    """The output and error files of a job: what they hold already, and appending to them."""

    def __init__(self, out: Path, errors: Path) -> None:
        self.out, self.errors = out, errors
        self.done: set[str] = set()
        """custom_ids of requests served for good (either file)."""
        self.bad_lines: set[int] = set()
        """Input line numbers reported as invalid in the error file."""
        self.server_failures = 0
        """Requests of this run that failed on the server (status >= 500)."""
        self._failures: set[str] = set()
        """custom_ids of the server-failure records in the error file."""
        self._invalid_ids: set[str] = set()
        """custom_ids of the invalid lines reported in the error file."""
        for path in (out, errors):
            for record in _records(path):
                custom_id, error = record.get("custom_id"), record.get("error") or {}
                if error.get("code") == "invalid_request":  # by line: a repeated id is one
                    self.bad_lines.add(int(error.get("line", 0)))
                    if custom_id is not None:
                        self._invalid_ids.add(str(custom_id))
                elif _failed_on_server(record):
                    self._failures.add(str(custom_id))
                else:
                    self.done.add(str(custom_id))
        self._out: IO[str] | None = None
        self._errors: IO[str] | None = None

    @property
    def failed(self) -> set[str]:
        """custom_ids of requests that failed on the server and are not served for good since:
        run again (`retry`)."""
        return self._failures - self.done

    def finished(self, line: JobLine | LineError) -> bool:
        """Whether an earlier run already wrote this line's final result or error (a failure on
        the server is not final: see `retry`)."""
        if isinstance(line, LineError):
            return line.number in self.bad_lines
        return line.custom_id in self.done

    def retry(self, lines: list[JobLine]) -> int:
        """Takes out of the error file the server-failure records of those of `lines` that
        failed (so each is run again and recorded once) and of custom_ids served for good or
        reported as an invalid line since (superseded: else the id would show twice); returns
        the number of `lines` run again. Call it right before they run: a command that stops
        sooner must leave their records, or their requests would be in neither file.

        The file is rewritten whole into a temporary file that then replaces it (`os.replace`,
        atomic, the directory synced after it): a job killed at any moment leaves either the
        old file or the new one, and a line whose record is gone is not finished, so the next
        run runs it."""
        again = {line.custom_id for line in lines if line.custom_id in self.failed}
        drop = self._failures & (again | self.done | self._invalid_ids)
        if not drop:
            return 0
        if self._errors is not None:  # appended to so far: flushed, read back below
            self._errors.close()
            self._errors = None
        kept = [record for record in _records(self.errors)
                if not (_failed_on_server(record) and record.get("custom_id") in drop)]
        temporary = self.errors.with_name(self.errors.name + ".tmp")
        with temporary.open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in kept)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.errors)
        _sync_directory(self.errors.parent)
        self._failures -= drop
        return len(again)

    def result(self, line: JobLine, status: int, body: dict[str, Any]) -> None:
        """Writes a served request: to the output on status 200, else to the error file."""
        response = {"status_code": status, "request_id": str(body.get("id") or _new_id()),
                    "body": body}
        record = {"id": f"batch_req_{_new_id()}", "custom_id": line.custom_id,
                  "response": response, "error": None}
        if status != 200:
            record["error"] = {"code": "request_failed", "message": _message(body),
                               "line": line.number}
        self._write(record, status == 200)
        if _failed_on_server(record):
            self._failures.add(line.custom_id)
            self.server_failures += 1
        else:
            self.done.add(line.custom_id)

    def error(self, line: LineError) -> None:
        """Writes an input line that could not run."""
        self._write({"id": f"batch_req_{_new_id()}", "custom_id": line.custom_id,
                     "response": None, "error": {"code": "invalid_request",
                                                 "message": f"line {line.number}: {line.reason}",
                                                 "line": line.number}}, False)
        self.bad_lines.add(line.number)
        if line.custom_id is not None:
            self._invalid_ids.add(line.custom_id)

    def close(self) -> None:
        """Closes the files opened so far."""
        for handle in (self._out, self._errors):
            if handle is not None:
                handle.close()

    def _write(self, record: dict[str, Any], ok: bool) -> None:
        if ok:
            self._out = self._out or self.out.open("a", encoding="utf-8")
            handle = self._out
        else:
            self._errors = self._errors or self.errors.open("a", encoding="utf-8")
            handle = self._errors
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()  # a killed job keeps every line written so far


def _records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a result file (a last line cut short by a kill is truncated)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as handle:
            handle.truncate(end)
    records = []
    for number, text in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {number} is not JSON; it is not a result file of "
                             "this job (remove it or pick another path)") from None
        records.append(record)
    return records


def _sync_directory(path: Path) -> None:
    """Makes a rename in the directory `path` durable, so a power loss cannot bring an old record
    back beside its new one. Only where a directory can be opened (O_DIRECTORY: POSIX); on
    Windows a directory cannot be opened to sync."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _failed_on_server(record: dict[str, Any]) -> bool:
    """Whether a result record is a server-side failure (status >= 500), which a rerun retries."""
    status = (record.get("response") or {}).get("status_code")
    return isinstance(status, int) and status >= 500


def _message(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return json.dumps(body)[:500]


def _new_id() -> str:
    return uuid.uuid4().hex


async def run_job(lines: list[JobLine], files: JobFiles, answer: Answer,
                  on_result: Callable[[int], None], in_flight: int) -> None:
    """Serves `lines` through `answer`, `in_flight` at a time (all of them submitted together
    when it is at least their number), writing each result as it ends; `on_result(tokens)`
    after each, with its completion tokens."""
    gate = asyncio.Semaphore(in_flight)

    async def one(line: JobLine) -> None:
        async with gate:
            status, body = await answer(line.url, line.body)
        files.result(line, status, body)
        usage = body.get("usage") if status == 200 else None
        on_result(int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0)

    await asyncio.gather(*(one(line) for line in lines))
