"""`hetmoe batch`: OpenAI Batch lines answered as the API answers them, bad lines reported per
line without stopping the job, a killed job resumed with each custom_id exactly once, lines that
failed on the server tried again on a rerun, and the progress bar's fields."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import rich
from rich.console import Console
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.cli import app
from hetmoe.cli_batch import SERVER_FAILURES_EXIT
from hetmoe.cli_engine import EngineOptions
from hetmoe.engine.requests import batch_job
from hetmoe.engine.requests.batch_job import JobFiles, JobLine, LineError, read_lines
from hetmoe.server.service import ModelService

MODEL = "tiny-qwen3-moe"
runner = CliRunner()


@pytest.fixture()
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache shared by the CLI tests (presets build once)."""
    path = tmp_path_factory.getbasetemp() / "cli-cache"
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(path))
    return path


def chat_line(custom_id: str, text: str, tokens: int) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}],
                     "max_tokens": tokens}}


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def results(path: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), f"a custom_id twice in {path}: {sorted(ids)}"
    return {r["custom_id"]: r for r in records}


def test_lines_are_answered_as_single_requests_and_bad_lines_reported(
    cache: Path, tmp_path: Path
) -> None:
    good = [chat_line("a", "Hello", 8), chat_line("b", "What is MoE?", 5),
            {"custom_id": "c", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "Once upon", "max_tokens": 6}}]
    bad = ["not json", {**chat_line("a", "again", 2)}, {**chat_line("x", "Hi", 2), "url": "/v2"},
           {"method": "POST", "url": "/v1/completions", "body": {}},
           {**chat_line("s", "Hi", 2), "body": {"messages": [], "stream": True}},
           {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": "oops"}}]
    source = write(tmp_path / "in.jsonl", [good[0], good[1], *bad, good[2]])
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["batch", str(source), str(out), "--device", "cpu",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    answered = results(out)
    llm = LLM(MODEL, device="cpu", progress=False)
    for line in good[:2]:
        body = answered[line["custom_id"]]["response"]["body"]
        want = llm.chat(line["body"]["messages"], max_new_tokens=line["body"]["max_tokens"])
        assert body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["completion_tokens"] == line["body"]["max_tokens"]
    text = answered["c"]["response"]["body"]["choices"][0]["text"]
    assert text == llm.generate("Once upon", max_new_tokens=6).text
    assert answered["a"]["response"]["status_code"] == 200 and answered["a"]["error"] is None
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    messages = {e["error"]["line"]: e["error"]["message"] for e in errors}
    assert messages[3].startswith("line 3: not JSON")
    assert messages[4] == "line 4: custom_id 'a' repeats line 1"
    assert messages[5] == ("line 5: field 'url' must be one of /v1/chat/completions, "
                           "/v1/completions, got '/v2'")
    assert messages[6] == "line 6: field 'custom_id' must be a non-empty string"
    assert messages[7] == ("line 7: field 'body.stream': a batch request is answered whole, "
                           "not streamed")
    assert messages[8] == "field 'messages': Input should be a valid array (got 'oops')"
    failed = next(e for e in errors if e["custom_id"] == "m")
    assert failed["response"]["status_code"] == 400
    again = runner.invoke(app, ["batch", str(source), str(out), "--no-progress"])
    assert again.exit_code == 0 and "nothing to run" in again.output  # all kept, none twice
    assert len(results(out)) == 3


def test_a_killed_job_resumes_with_each_custom_id_once(cache: Path, tmp_path: Path) -> None:
    lines = [chat_line(f"r{i}", f"Question {i}", 24) for i in range(40)]
    source = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "hetmoe.cli", "batch", str(source), str(out),
               "--device", "cpu", "--max-batch", "2", "--no-progress"]
    job = subprocess.Popen(command, env={**os.environ, "HETMOE_CACHE_DIR": str(cache)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 3:
                break
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
    finally:
        job.wait()
    kept = results(out)
    assert 3 <= len(kept) < len(lines), "the job was not killed midway"
    with out.open("a") as handle:
        handle.write('{"id": "batch_req_cut", "custom_id": "r3')  # a line cut by the kill
    result = runner.invoke(app, ["batch", str(source), str(out), "--device", "cpu",
                                 "--max-batch", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    final = results(out)
    assert sorted(final) == sorted(line["custom_id"] for line in lines)
    for custom_id, record in kept.items():
        assert final[custom_id] == record  # finished lines kept as they were
    llm = LLM(MODEL, device="cpu", progress=False)
    for line in lines[::13]:
        want = llm.chat(line["body"]["messages"], max_new_tokens=24).text
        assert final[line["custom_id"]]["response"]["body"]["choices"][0]["message"][
            "content"] == want


def test_result_files_of_another_kind_are_refused(tmp_path: Path) -> None:
    out = write(tmp_path / "out.jsonl", ["a table, not results"])
    with pytest.raises(ValueError, match=r"out.jsonl: line 1 is not JSON; it is not a result"):
        JobFiles(out, tmp_path / "errors.jsonl")
    lines = list(read_lines(write(tmp_path / "in.jsonl", ["[1, 2]", '{"custom_id": "z"}'])))
    assert lines == [LineError(1, None, "expected a JSON object, got list"),
                     LineError(2, "z", "field 'method' must be \"POST\", got None")]


def test_an_invalid_line_never_hides_a_request_of_the_same_custom_id(tmp_path: Path) -> None:
    # Killed after line 2 (a repeat of "a") was reported but before line 1 ("a") was answered:
    # the rerun must still answer line 1, and report line 2 no more.
    source = write(tmp_path / "in.jsonl", [chat_line("a", "Hi", 2), chat_line("a", "Ho", 2)])
    first, repeat = list(read_lines(source))
    assert isinstance(repeat, LineError) and repeat.reason == "custom_id 'a' repeats line 1"
    files = JobFiles(tmp_path / "out.jsonl", tmp_path / "errors.jsonl")
    files.error(repeat)
    files.close()
    again = JobFiles(tmp_path / "out.jsonl", tmp_path / "errors.jsonl")
    assert not again.finished(first) and again.finished(repeat)


def test_a_sample_of_the_job_places_its_most_routed_experts(cache: Path, tmp_path: Path) -> None:
    lines = [chat_line(f"q{i}", f"Question number {i}", 4) for i in range(6)]
    source = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    # On the CPU device the "GPU" experts are host memory: the plan and its counts still hold.
    result = runner.invoke(app, ["batch", str(source), str(out), "--device", "cpu",
                                 "--experts", "cpu", "--gpu-expert-gib", "0.0001",
                                 "--placement-sample", "3", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "pre-placement: 3 sampled prompts (" in result.output
    assert "GiB of experts on the GPU, the most routed per layer: " in result.output
    assert sorted(results(out)) == sorted(line["custom_id"] for line in lines)
    refused = runner.invoke(app, ["batch", str(source), str(tmp_path / "o2.jsonl"),
                                  "--device", "cpu", "--gpu-expert-gib", "0",
                                  "--placement-sample", "3", "--no-progress"])
    assert refused.exit_code == 1
    assert ("error: --placement-sample needs a GPU expert budget to place experts in "
            "(--gpu-expert-gib > 0 or auto), got --gpu-expert-gib 0") in refused.output
    negative = runner.invoke(app, ["batch", str(source), str(tmp_path / "o3.jsonl"),
                                   "--placement-sample", "-1", "--no-progress"])
    assert negative.exit_code == 1
    assert "error: --placement-sample must be >= 0 prompts, got -1" in negative.output


def test_a_rerun_retries_only_the_lines_that_failed_on_the_server(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine faults on the lines of 7 (an unexpected error: 500) and 9 (the engine stopped:
    # 503) max_tokens in the first run only; "bad" is the request's own fault (400): final.
    lines = [chat_line("ok", "Hello", 4), chat_line("fault", "Why?", 7),
             chat_line("stopped", "How?", 9),
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": "oops"}}]
    source, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    errors, submit = tmp_path / "out.errors.jsonl", ModelService.submit
    served: list[int] = []  # max_tokens of the requests submitted
    faulty = [True]

    def submitted(self: ModelService, prompts: Any, params: Any, *rest: Any) -> Any:
        served.append(params.max_new_tokens)
        if faulty[0] and params.max_new_tokens == 7:
            raise IndexError("engine fault")
        if faulty[0] and params.max_new_tokens == 9:
            raise RuntimeError("the engine stopped")
        return submit(self, prompts, params, *rest)

    monkeypatch.setattr(ModelService, "submit", submitted)
    command = ["batch", str(source), str(out), "--device", "cpu", "--no-progress"]
    first = runner.invoke(app, command)
    assert first.exit_code == SERVER_FAILURES_EXIT == 3, first.output  # a script knows to rerun
    assert "2 requests answered into" in first.output  # "ok" and "bad": a 4xx is an answer
    assert ("2 lines failed on the server: rerun the same command to try them again"
            in first.output)
    help_text = " ".join(runner.invoke(app, ["batch", "--help"]).output.split())
    assert (f"{SERVER_FAILURES_EXIT} when requests failed on the server in this run (rerun the "
            "same command to try them again)") in help_text
    failed = results(errors)
    assert sorted(failed) == ["bad", "fault", "stopped"] and sorted(results(out)) == ["ok"]
    assert failed["fault"]["response"]["status_code"] == 500
    assert failed["fault"]["error"]["message"] == "internal error: IndexError: engine fault"
    assert failed["stopped"]["response"]["status_code"] == 503
    assert failed["bad"]["response"]["status_code"] == 400
    answered, served[:], faulty[0] = results(out), [], False
    again = runner.invoke(app, command)
    assert again.exit_code == 0, again.output  # the 400 kept from the first run: still 0
    assert "2 lines failed on the server last time: trying them again" in again.output
    assert "2 requests answered into" in again.output
    assert sorted(served) == [7, 9]  # the two failed lines, not "ok" nor "bad"
    final, kept = results(out), results(errors)
    assert sorted(final) == ["fault", "ok", "stopped"] and sorted(kept) == ["bad"]
    assert final["ok"] == answered["ok"] and kept["bad"] == failed["bad"]
    assert final["fault"]["response"]["status_code"] == 200
    assert final["fault"]["response"]["body"]["usage"]["completion_tokens"] <= 7
    third = runner.invoke(app, command)
    assert third.exit_code == 0 and "nothing to run" in third.output
    assert "failed on the server" not in third.output


def _failure(custom_id: str, status: int, line: int) -> dict[str, Any]:
    """An error-file record of a served request, as `JobFiles.result` writes it."""
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": "r", "body": {}},
            "error": {"code": "request_failed", "message": "m", "line": line}}


def test_the_error_file_rewrite_keeps_every_line_whenever_the_job_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = write(tmp_path / "out.jsonl", [{"id": "batch_req_a", "custom_id": "a", "error": None,
                                           "response": {"status_code": 200, "body": {}}}])
    invalid = {"id": "batch_req_x", "custom_id": None, "response": None,
               "error": {"code": "invalid_request", "message": "line 5: x", "line": 5}}
    # "d" failed on the server in an earlier input: not among this run's lines, so kept.
    errors = write(tmp_path / "errors.jsonl", [_failure("b", 400, 2), _failure("c", 500, 3),
                                               invalid, _failure("d", 502, 4)])
    before = errors.read_bytes()
    a, b, c = (JobLine(n, i, "/v1/completions", {}) for n, i in ((1, "a"), (2, "b"), (3, "c")))
    files = JobFiles(out, errors)
    assert [files.finished(x) for x in (a, b, c)] == [True, True, False]
    assert files.finished(LineError(5, None, "x"))

    def killed(*args: Any) -> None:
        raise KeyboardInterrupt  # stopped between writing the new file and replacing the old

    monkeypatch.setattr(batch_job.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        files.retry([c])
    assert errors.read_bytes() == before and not JobFiles(out, errors).finished(c)
    monkeypatch.undo()
    synced: list[bool] = []  # per fsync: of a directory?
    fsync = os.fsync

    def recorded(handle: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(handle).st_mode))
        fsync(handle)

    monkeypatch.setattr(batch_job.os, "fsync", recorded)
    files = JobFiles(out, errors)
    files.error(LineError(6, None, "y"))  # appended before the rewrite: kept by it
    assert files.retry([a, b, c]) == 1 and files.retry([c]) == 0
    assert synced == [False, True]  # the new file, then the rename in its directory
    assert not (tmp_path / "errors.jsonl.tmp").exists()
    kept = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [r["custom_id"] for r in kept] == ["b", None, "d", None]
    assert kept[:3] == [_failure("b", 400, 2), invalid, _failure("d", 502, 4)]
    killed_now = JobFiles(out, errors)  # killed before "c" ran: it runs next time
    assert not killed_now.finished(c) and killed_now.finished(b)
    files.result(c, 200, {"id": "chatcmpl-c"})
    files.close()
    ids = [*results(out), *[r["custom_id"] for r in kept if r["custom_id"]]]
    assert sorted(ids) == ["a", "b", "c", "d"]
    assert JobFiles(out, errors).finished(c)


def test_a_command_that_stops_before_its_job_leaves_the_error_file_as_it_was(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "a" failed on the server last time; this run stops before its job (a model that does not
    # exist, then Ctrl-C during the load): its record must stay, or "a" would be in neither file.
    errors = write(tmp_path / "out.errors.jsonl", [_failure("a", 500, 1)])
    before, out = errors.read_bytes(), tmp_path / "out.jsonl"
    line = chat_line("a", "Hello", 4)
    command = ["batch", str(tmp_path / "in.jsonl"), str(out), "--device", "cpu", "--no-progress"]
    write(tmp_path / "in.jsonl", [{**line, "body": {**line["body"], "model": "no-such-model"}},
                                  "not json"])
    missing = runner.invoke(app, command)
    assert missing.exit_code == 1
    assert "error: model 'no-such-model' is neither an existing directory" in missing.output
    assert "trying it again" not in missing.output
    assert errors.read_bytes() == before and not out.exists()  # not even the invalid line 2

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    write(tmp_path / "in.jsonl", [line, "not json"])
    monkeypatch.setattr(EngineOptions, "load", interrupted)
    stopped = runner.invoke(app, command)
    assert stopped.exit_code != 0 and "trying it again" not in stopped.output
    assert errors.read_bytes() == before and not out.exists()
    monkeypatch.undo()
    ran = runner.invoke(app, command)
    assert ran.exit_code == 0, ran.output
    assert "1 line failed on the server last time: trying it again" in ran.output
    assert sorted(results(out)) == ["a"] and list(results(errors)) == [None]


def test_an_edited_line_or_an_answered_one_supersedes_its_failure_record(
    cache: Path, tmp_path: Path
) -> None:
    # "x" got a 500, then its line was edited to be invalid; "a" has a 500 beside its final
    # answer (a kill between the two); "y" got a 503 and is run again.
    out = write(tmp_path / "out.jsonl", [{"id": "batch_req_a", "custom_id": "a", "error": None,
                                           "response": {"status_code": 200, "body": {}}}])
    errors = write(tmp_path / "out.errors.jsonl", [_failure("x", 500, 2), _failure("a", 500, 1),
                                                   _failure("y", 503, 3)])
    assert JobFiles(out, errors).failed == {"x", "y"}  # "a" is answered: not run again
    source = write(tmp_path / "in.jsonl", [chat_line("a", "Hi", 2),
                                           {**chat_line("x", "Hi", 2), "url": "/v2"},
                                           chat_line("y", "Why?", 3)])
    command = ["batch", str(source), str(out), "--device", "cpu", "--no-progress"]
    ran = runner.invoke(app, command)
    assert ran.exit_code == 0, ran.output
    assert "1 line failed on the server last time: trying it again" in ran.output
    answered, reported = results(out), results(errors)
    assert sorted(answered) == ["a", "y"] and answered["y"]["response"]["status_code"] == 200
    assert list(reported) == ["x"] and reported["x"]["error"]["code"] == "invalid_request"
    with errors.open("a") as handle:  # as a kill between the invalid record and the rewrite
        handle.write(json.dumps(_failure("x", 500, 2)) + "\n")
    again = runner.invoke(app, command)
    assert again.exit_code == 0 and "nothing to run" in again.output
    assert [r["error"]["code"] for r in results(errors).values()] == ["invalid_request"]
    assert sorted(results(out)) == ["a", "y"]


def test_the_progress_bar_shows_the_count_the_rate_and_the_eta(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [chat_line(f"p{i}", f"Question {i}", 6) for i in range(3)]
    source, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    screen = io.StringIO()  # a terminal's screen: the bar redraws in place
    monkeypatch.setattr(rich, "_console", Console(file=screen, force_terminal=True, width=160,
                                                  color_system=None))
    started = time.perf_counter()
    result = runner.invoke(app, ["batch", str(source), str(out), "--device", "cpu"])
    wall = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    # Each frame: batch [bar] done/total rate tok/s elapsed ETA remaining (-:--:--: unknown).
    frames = re.findall(r"batch\D*?(\d+)/(\d+) ([\d.]+) tok/s \d+:\d\d:\d\d ETA (\S+)",
                        screen.getvalue())
    assert frames[0] == ("0", "3", "0.0", "-:--:--"), screen.getvalue()
    counts = [int(frame[0]) for frame in frames]
    assert counts == sorted(counts) and all(frame[1] == "3" for frame in frames)
    done, _, rate, eta = frames[-1]
    assert (done, eta) == ("3", "0:00:00")
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"]
                 for r in results(out).values())
    # tokens over the time to the last result: no less than over the whole command's time.
    assert tokens > 0 and tokens / wall - 0.05 <= float(rate) < 1e6
