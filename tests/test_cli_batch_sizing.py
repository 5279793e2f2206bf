"""`hetmoe batch` sizes its KV cache from the job (cli_batch_sizing.py): the window from the
lines' prompts as the routes tokenize them + max_tokens, the slots from its sequences and the
memory; explicit numbers; lines longer than the window answered with their own 400; an error
before the weights load when not one slot fits; the help that says so."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig
from typer.testing import CliRunner

from hetmoe.cli import app
from hetmoe.cli_batch_sizing import JobTokens, LineNeed, line_need, window_of
from hetmoe.engine.requests.batch_job import JobLine
from hetmoe.loading.memory_plan import kv_bytes_per_token
from hetmoe.presets import resolve_model

MODEL = "tiny-qwen3-moe"
runner = CliRunner()
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.fixture()
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache shared by the CLI tests (presets build once)."""
    path = tmp_path_factory.getbasetemp() / "cli-cache"
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(path))
    return path


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id: str, text: str, tokens: int, **more: Any) -> dict[str, Any]:
    return line(custom_id, "/v1/chat/completions", model=MODEL, max_tokens=tokens,
                messages=[{"role": "user", "content": text}], **more)


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def records(path: Path) -> dict[str, dict[str, Any]]:
    return {r["custom_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def token_bytes() -> int:
    return kv_bytes_per_token(AutoConfig.from_pretrained(resolve_model(MODEL)), torch.float32)


def run(*args: str) -> Any:
    return runner.invoke(app, ["batch", *args, "--device", "cpu", "--no-progress"])


def test_a_small_job_gets_its_longest_line_as_window_and_its_sequences_as_slots(
    cache: Path, tmp_path: Path
) -> None:
    lines = [chat("a", "Hello", 8), chat("b", "What is a mixture of experts?", 20),
             line("p", "/v1/completions", prompt=["Once upon", "a time"], max_tokens=5, n=2),
             line("x", "/v1/completions", prompt=[1, 2, 3], max_tokens=0, echo=True)]
    out = tmp_path / "out.jsonl"
    result = run(str(write(tmp_path / "in.jsonl", lines)), str(out))
    assert result.exit_code == 0, result.output
    done = records(out)
    assert sorted(done) == ["a", "b", "p", "x"]
    # The routes' own prompt token counts (usage) + max_tokens: what the window was sized by.
    usage = {k: r["response"]["body"]["usage"]["prompt_tokens"] for k, r in done.items()}
    longest = max(usage[x["custom_id"]] + x["body"]["max_tokens"] for x in lines[:2])
    assert longest > max(usage["p"], 3 + 1)
    kv = 7 * 256 * token_bytes()  # 2 chats + 2 prompts x n=2 + 1 scored prompt
    assert (f"batch KV cache: 7 slots x 256 tokens = 0.00 GiB of KV ({kv} bytes) on the host "
            f"(cpu); slots: the job's 7 sequences; window: the longest line's prompt + "
            f"max_tokens, {longest} tokens, rounded up to 256\n") in result.output


def test_a_chat_line_is_sized_by_the_prompt_its_route_renders(cache: Path) -> None:
    from hetmoe import LLM
    from hetmoe.server import protocol, tools
    from hetmoe.server.service import ModelService

    llm = LLM(MODEL, device="cpu", progress=False)
    service = ModelService(llm, MODEL, max_queue=8)
    job = JobTokens(llm.tokenizer)
    needs = {}
    try:
        for given in (chat("t", "Add one and two", 6, tools=[TOOL], n=3),
                      chat("s", "Add one and two", 2, max_completion_tokens=9)):
            body = protocol.ChatCompletionRequest.model_validate(given["body"])
            ids = tools.render_chat(service, body.messages,
                                    tools.plan_tools(body, service.chat_template))
            need = line_need(JobLine(1, given["custom_id"], given["url"], given["body"]), MODEL,
                             job)
            assert need is not None and need.prompt == len(ids)
            assert (need.budget, need.sequences) == (body.token_budget, body.n)
            needs[given["custom_id"]] = need
    finally:
        service.close()
    assert needs["t"].prompt > needs["s"].prompt + 100  # the tool prompt is counted
    assert (needs["t"].budget_field, needs["s"].budget_field) == ("max_tokens",
                                                                  "max_completion_tokens")
    bad = chat("m", "Hi", 2)
    bad["body"]["messages"] = "oops"  # the route answers its 400: it holds no KV
    assert line_need(JobLine(1, "m", bad["url"], bad["body"]), MODEL, job) is None
    other = chat("o", "Hi", 2)
    other["body"]["model"] = "another-model"  # the route's 404
    assert line_need(JobLine(1, "o", other["url"], other["body"]), MODEL, job) is None


def test_explicit_numbers_are_used_as_given(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    result = run(str(write(tmp_path / "in.jsonl", [chat("a", "Hi", 4), chat("b", "Ho", 4)])),
                 str(out), "--max-batch", "3", "--max-seq-len", "64")
    assert result.exit_code == 0, result.output
    kv = 3 * 64 * token_bytes()
    assert (f"batch KV cache: 3 slots x 64 tokens = 0.00 GiB of KV ({kv} bytes) on the host "
            "(cpu); slots: --max-batch 3; window: --max-seq-len 64\n") in result.output
    assert sorted(records(out)) == ["a", "b"]
    for value in ("0", "x"):
        refused = run(str(tmp_path / "in.jsonl"), str(tmp_path / "o.jsonl"), "--max-batch", value)
        assert refused.exit_code == 1
        assert f"error: --max-batch takes auto or an integer >= 1, got '{value}'" in refused.output


def test_a_line_longer_than_the_window_gets_its_error_and_the_job_goes_on(
    cache: Path, tmp_path: Path
) -> None:
    lines = [chat("ok", "Hi", 4),
             line("long", "/v1/completions", prompt=list(range(1, 201)), max_tokens=100),
             line("open", "/v1/completions", prompt=list(range(1, 60)))]  # to the window's end
    source = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run(str(source), str(out))
    assert result.exit_code == 0, result.output
    message = ("field 'max_tokens': prompt (200 tokens) + max_tokens (100) = 300 tokens exceed "
               "the batch's window of 256 tokens (the model's context, 256 tokens)")
    assert f"in.jsonl: line 2: {message}" in result.output
    assert ("window: 1 of the lines set no max_tokens (each generates to the window's end): "
            "the longest need, 256 tokens, rounded up to 256 (such a line needs the default "
            "window, 256 tokens, or its prompt + 1)") in result.output
    assert sorted(records(out)) == ["ok", "open"]
    failed = records(tmp_path / "out.errors.jsonl")["long"]
    assert failed["error"] == {"code": "request_failed", "message": message, "line": 2}
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["param"] == "max_tokens"
    again = run(str(source), str(out))  # answered once: a rerun has nothing left
    assert again.exit_code == 0 and "nothing to run" in again.output
    assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 1
    short = run(str(source), str(tmp_path / "o2.jsonl"), "--max-seq-len", "50")
    assert short.exit_code == 0, short.output
    assert ("line 3: field 'prompt': the prompt has 59 tokens, the batch's window is 50 tokens "
            "(--max-seq-len 50; at least one must be left to generate)") in short.output
    assert sorted(records(tmp_path / "o2.jsonl")) == ["ok"]


def test_a_job_of_only_too_long_lines_answers_them_without_loading_the_model(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", never)
    source = write(tmp_path / "in.jsonl", [
        line("long", "/v1/completions", model=MODEL, prompt=list(range(1, 201)), max_tokens=100)])
    out = tmp_path / "out.jsonl"
    result = run(str(source), str(out))
    assert result.exit_code == 0, result.output
    errors = tmp_path / "out.errors.jsonl"
    assert result.output.endswith("nothing to run: every line left is longer than the window "
                                  f"(errors: {errors})\n")
    assert records(errors)["long"]["response"]["status_code"] == 400
    assert not out.exists()


def test_not_even_one_slot_is_refused_before_the_weights_load(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(str(write(tmp_path / "warm.jsonl", [chat("w", "Hi", 1)])), str(tmp_path / "w.jsonl"))

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("hetmoe.cli_engine.load_llm", never)
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available", lambda: 2**30)
    result = run(str(write(tmp_path / "in.jsonl", [chat("a", "Hi", 4)])),
                 str(tmp_path / "out.jsonl"))
    assert result.exit_code == 1, result.output
    per_token = token_bytes()
    found = re.search(r"error: not even one KV slot fits: .*", result.output)
    assert found is not None, result.output
    assert found.group(0).startswith(
        f"error: not even one KV slot fits: one slot of 256 tokens takes {256 * per_token} "
        f"bytes ({per_token} bytes per token), and the host (cpu) has 0 bytes for the KV cache "
        f"({2**30} bytes available, less ")
    assert found.group(0).endswith(f" of routed experts and other weights, {2**30} of margin); "
                                   "lower --max-seq-len or the lines' max_tokens, or free memory")


def test_the_auto_window_rounds_up_to_256_and_stops_at_the_context() -> None:
    def need(prompt: int, budget: int | None) -> LineNeed:
        return LineNeed(JobLine(1, "c", "/v1/completions", {}), prompt, budget, "max_tokens",
                        "prompt", 1)

    assert window_of([need(512, 128), need(30, 8)], 4096, None)[:2] == (
        768, "the longest line's prompt + max_tokens, 640 tokens, rounded up to 768")
    assert window_of([need(4000, 90)], 4096, None)[:2] == (4096, (
        "the longest line's prompt + max_tokens, 4090 tokens, rounded up to 4096"))
    assert window_of([need(300, 10), need(5000, 10)], 4000, None)[:2] == (
        512, "the longest line's prompt + max_tokens, 310 tokens, rounded up to 512")
    assert window_of([need(3900, 50)], 4000, None)[:2] == (4000, (
        "the longest line's prompt + max_tokens, 3950 tokens, rounded up to 4096, capped at "
        "the model's context, 4000 tokens"))
    # No max_tokens: the engine's default window (a long context capped at 4096), not the
    # whole context; a longer prompt + 1.
    assert window_of([need(300, None), need(30, 8)], 40960, None)[:2] == (4096, (
        "1 of the lines set no max_tokens (each generates to the window's end): the longest "
        "need, 4096 tokens, rounded up to 4096 (such a line needs the default window, 4096 "
        "tokens, or its prompt + 1)"))
    assert window_of([need(5000, None)], 40960, None)[0] == 5120
    assert window_of([need(5000, None)], 256, None)[0] == 256  # past the context: refused
    assert window_of([need(100, 10)], 4096, 128) == (128, "--max-seq-len 128",
                                                      "--max-seq-len 128")
    assert need(100, 28).refusal(128, "why") is None  # a full window is fine
    assert need(100, 29).refusal(128, "why") == ("max_tokens", (
        "field 'max_tokens': prompt (100 tokens) + max_tokens (29) = 129 tokens exceed the "
        "batch's window of 128 tokens (why)"))
    assert need(128, None).refusal(128, "why") == ("prompt", (
        "field 'prompt': the prompt has 128 tokens, the batch's window is 128 tokens (why; at "
        "least one must be left to generate)"))


def test_the_help_says_what_auto_means_and_who_gets_the_memory() -> None:
    result = runner.invoke(app, ["batch", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    # One option each: batch's own replaces the engine options' --max-seq-len.
    assert text.count("--max-seq-len <str>") == 1 and text.count("--max-batch <str>") == 1
    assert ("The KV cache is sized from the job before the weights load (--max-batch, "
            "--max-seq-len), in one line that says slots x window, GiB and where.") in text
    assert ("auto = the job's sequences (prompts x n of the lines to run), at most the slots "
            "whose KV cache fits the memory the weights leave, at most 256; or a number") in text
    assert ("On a GPU the KV cache takes the room --gpu-expert-gib auto would take, so it comes "
            "first and auto experts get what it leaves") in text
    assert "--gpu-expert-gib N is set aside before it" in text
    assert ("auto = the longest line's prompt (as the chat template renders it) + max_tokens "
            "(none: generates to the window's end, in the default window of the model's context "
            "capped at 4096, or its prompt + 1 if longer), rounded up to a multiple of 256, "
            "capped at the model's context; or a number") in text
