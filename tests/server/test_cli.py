"""`hetmoe serve` as a real process, and `hetmoe chat --url` streaming from it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from hetmoe.cli import app

KEY = "cli-key"


@pytest.fixture(scope="module")
def served(tiny_qwen3_moe: Path) -> Iterator[str]:
    """The URL of `hetmoe serve` on a free port (the port is read from uvicorn's log line)."""
    command = [
        sys.executable, "-m", "hetmoe.cli", "serve", str(tiny_qwen3_moe), "--port", "0",
        "--api-key", KEY, "--model-name", "tiny", "--device", "cpu", "--max-seq-len", "256",
        "--max-batch", "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr is not None
    url = None
    log: list[str] = []
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        log.append(line)
        found = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        url = found.group(1) if found else None
    if url is None:
        process.kill()
        pytest.fail("hetmoe serve did not start:\n" + "".join(log))
    yield url
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 0


def test_serve_binds_loopback_and_answers(served: str) -> None:
    assert served.startswith("http://127.0.0.1:")
    assert httpx.get(served + "/health").json() == {"status": "ok"}
    assert httpx.get(served + "/v1/models").status_code == 401
    with OpenAI(base_url=served + "/v1", api_key=KEY) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_url_streams_the_servers_answer(served: str) -> None:
    history = [{"role": "user", "content": "Hello!"}]
    with OpenAI(base_url=served + "/v1", api_key=KEY) as client:
        first = client.chat.completions.create(model="tiny", messages=history, max_tokens=10,
                                               temperature=0).choices[0].message.content or ""
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again?"}]
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=10,
                                                temperature=0).choices[0].message.content or ""
    result = CliRunner().invoke(
        app,
        ["chat", "tiny", "--url", served, "--api-key", KEY, "--temperature", "0",
         "--max-new-tokens", "10"],
        input="Hello!\nAgain?\n/exit\n",
    )
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"chat with tiny at {served}: type a message; /help lists the commands, /exit quits\n"
        f"> {first}\n> {second}\n> "
    )


def test_chat_url_checks_the_server_at_start(served: str) -> None:
    """A wrong key or model name ends `chat --url` before its prompt, naming the URL."""
    wrong_key = CliRunner().invoke(
        app, ["chat", "tiny", "--url", served, "--api-key", "wrong"], input="Hi\n"
    )
    assert wrong_key.exit_code == 1 and "> " not in wrong_key.output
    assert (
        f"error: no hetmoe (or OpenAI-compatible) server answers at {served}/v1: 401 from "
        f"{served}/v1/models: missing or invalid API key: send 'Authorization: Bearer <key>'"
    ) in wrong_key.output
    unknown = CliRunner().invoke(app, ["chat", "other", "--url", served, "--api-key", KEY],
                                 input="Hi\n")
    assert unknown.exit_code == 1
    assert f"error: the server at {served}/v1 serves 'tiny', not 'other'" in unknown.output


def test_chat_url_to_a_dead_server_exits_at_once() -> None:
    with socket.socket() as sock:  # a port nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    result = CliRunner().invoke(app, ["chat", "tiny", "--url", url], input="Hi\n")
    assert result.exit_code == 1 and "chat with" not in result.output
    assert result.output.startswith(
        f"error: no hetmoe (or OpenAI-compatible) server answers at {url}/v1: cannot reach "
        f"{url}/v1/models: ")
    assert "Connection refused" in result.output


def test_chat_url_reports_a_failed_turn_and_goes_on(served: str) -> None:
    result = CliRunner().invoke(
        app, ["chat", "tiny", "--url", served, "--api-key", KEY, "--max-new-tokens", "4"],
        input="harbour " * 300 + "\nHi\n/exit\n")
    assert result.exit_code == 0, result.output
    assert f"[error: 400 from {served}/v1/chat/completions: field 'messages': the prompt" \
        in result.output
    assert result.output.count("> ") == 3  # the session went on after the failed turn


def test_serve_passes_prefill_options_and_checks_them_before_loading(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from hetmoe import cli
    from hetmoe.server import app as server_app

    seen: dict[str, object] = {}
    monkeypatch.setattr("hetmoe.cli_engine.load_llm",
                        lambda model, device, rules, **o: seen.update(o))
    monkeypatch.setattr(server_app, "serve", lambda llm, name, config: None)
    runner = CliRunner()
    done = runner.invoke(cli.app, ["serve", "m", "--prefill-chunk", "512",
                                   "--prefill-experts", "split", "--prefill-resident-gib", "1.5"])
    assert done.exit_code == 0, done.output
    assert seen["prefill_chunk"] == 512 and seen["prefill_experts"] == "split"
    assert seen["gpu_expert_bytes"] == 3 * 2**29  # the former name of --gpu-expert-gib
    assert "--prefill-resident-gib is now --gpu-expert-gib" in done.output
    seen.clear()
    done = runner.invoke(cli.app, ["serve", "m", "--prefill-chunk", "0"])
    assert seen["prefill_chunk"] is None and seen["prefill_experts"] == "auto"
    assert seen["gpu_expert_bytes"] == "auto"
    seen.clear()
    done = runner.invoke(cli.app, ["serve", "m", "--prefill-resident-gib", "-1"])
    assert done.exit_code == 1 and "--prefill-resident-gib must be >= 0" in done.output
    assert seen == {}  # refused before loading
    words = " ".join(runner.invoke(cli.app, ["serve", "--help"]).output.split())
    assert "--prefill-resident-gib <float> Deprecated: the former name of" in words


def test_chat_template_option_reaches_the_engine_and_is_checked_first(
        tiny_qwen3_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe import cli
    from hetmoe.server import app as server_app

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    seen: dict[str, object] = {}
    with monkeypatch.context() as patched:
        patched.setattr("hetmoe.cli_engine.load_llm",
                        lambda model, device, rules, **o: seen.update(o))
        patched.setattr(server_app, "serve", lambda llm, name, config: None)
        done = CliRunner().invoke(cli.app, ["serve", "m", "--chat-template", str(template)])
    assert done.exit_code == 0, done.output
    assert seen["chat_template"] == template
    missing = CliRunner().invoke(app, ["generate", str(tiny_qwen3_moe), "Hi", "--device", "cpu",
                                       "--chat-template", str(tmp_path / "nope.jinja")])
    assert missing.exit_code == 1
    assert f"error: chat template '{tmp_path / 'nope.jinja'}': no such file" in missing.output
    answered = CliRunner().invoke(app, ["generate", str(tiny_qwen3_moe), "Hi", "--device", "cpu",
                                        "--max-new-tokens", "2", "--chat-template",
                                        str(template)])
    assert answered.exit_code == 0, answered.output
    remote = CliRunner().invoke(app, ["chat", "m", "--url", "http://127.0.0.1:9",
                                      "--chat-template", str(template)])
    assert remote.exit_code == 1 and "--chat-template applies to a model loaded here" in \
        remote.output
