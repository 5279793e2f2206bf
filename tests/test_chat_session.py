"""`hetmoe chat`'s session: /clear, /save, /help, multi-line input (unit), and the same through
the command on a preset."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.chat_session import MORE, PROMPT, ChatSession
from hetmoe.cli import app


class Terminal:
    """Typed lines in, everything shown (prompts included) out."""

    def __init__(self, *lines: str) -> None:
        self._lines: Iterator[str] = iter(lines)
        self.shown: list[str] = []

    def read(self, prompt: str) -> str:
        self.shown.append(prompt)
        try:
            return next(self._lines)
        except StopIteration:
            raise EOFError from None

    def write(self, text: str) -> None:
        self.shown.append(text)


def _run(*lines: str, system: str | None = None) -> tuple[ChatSession, list[list[dict[str, str]]],
                                                          Terminal]:
    terminal = Terminal(*lines)
    session = ChatSession(terminal.read, terminal.write, system)
    asked: list[list[dict[str, str]]] = []

    def answer(history: list[dict[str, str]]) -> str:
        asked.append([dict(m) for m in history])
        return f"reply {len(asked)}"

    session.run(answer)
    return session, asked, terminal


def test_multi_line_messages() -> None:
    _, asked, terminal = _run("first \\", "second\\", "third", '"""', "a", "", "b", '"""',
                              '"""one line"""', '"""open', "/clear", 'inside"""')
    sent = [turns[-1]["content"] for turns in asked]
    assert sent == ["first \nsecond\nthird", "a\n\nb", "one line", "open\n/clear\ninside"]
    assert terminal.shown[:4] == [PROMPT, MORE, MORE, PROMPT]


def test_clear_save_help_and_unknown_commands(tmp_path: Path) -> None:
    saved = tmp_path / "chat.json"
    session, asked, terminal = _run("Hi", "/save " + str(saved), "/clear", "Again", "/help",
                                    "/nope", "/save", f"/save {tmp_path}/missing/x.json",
                                    system="Be kind.")
    assert json.loads(saved.read_text()) == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "reply 1"}]
    # After /clear the next turn sees only the system message and itself.
    assert asked[1] == [{"role": "system", "content": "Be kind."},
                        {"role": "user", "content": "Again"}]
    shown = "".join(terminal.shown)
    assert f"[saved 3 messages to {saved}]" in shown and "[conversation cleared]" in shown
    assert "/save FILE writes it as JSON" in shown
    assert "[unknown command /nope; /help lists the commands]" in shown
    assert "[usage: /save FILE]" in shown
    assert f"[cannot save to {tmp_path}/missing/x.json: No such file or directory]" in shown
    assert len(session.history) == 3


def test_a_failed_turn_is_dropped_and_exit_ends() -> None:
    terminal = Terminal("Hi", "Again", "/exit", "never read")
    session = ChatSession(terminal.read, terminal.write)
    session.run(lambda history: None if history[-1]["content"] == "Hi" else "ok")
    assert session.history == [{"role": "user", "content": "Again"},
                               {"role": "assistant", "content": "ok"}]
    assert terminal.shown.count(PROMPT) == 3


def test_chat_command_clear_save_and_multi_line(tmp_path_factory: pytest.TempPathFactory,
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cli-cache"))
    saved = tmp_path / "history.json"
    typed = ["Hi \\", "there", "/clear", '"""', "How", "are you?", '"""', f"/save {saved}",
             "/exit"]
    result = CliRunner().invoke(app, ["chat", "tiny-mixtral", "--max-new-tokens", "6"],
                                input="\n".join(typed) + "\n")
    assert result.exit_code == 0, result.output
    llm = LLM("tiny-mixtral", progress=False)
    first = llm.chat([{"role": "user", "content": "Hi \nthere"}], max_new_tokens=6).text
    question = {"role": "user", "content": "How\nare you?"}
    second = llm.chat([question], max_new_tokens=6).text  # /clear: the first turn is gone
    assert first + "\n" in result.stdout and second + "\n" in result.stdout
    assert json.loads(saved.read_text()) == [question, {"role": "assistant", "content": second}]
    assert "[conversation cleared]" in result.stdout
