"""A terminal chat session (`hetmoe chat`, local or `--url`): the history, its commands and
multi-line input; the answer of each turn comes from a callback.

Commands: `/exit` or `/quit` ends the session (so does end of input), `/clear` forgets the
conversation (the system message stays), `/save FILE` writes the history as a JSON list of
`{"role", "content"}` messages (what chat APIs take), `/help` lists them. A line ending in `\\`
continues on the next line; a line starting with `\"\"\"` opens a block that a line ending in
`\"\"\"` closes (the quotes are not part of the message).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

PROMPT = "> "
MORE = "... "
"""The prompt of a continuation line."""
BLOCK = '"""'
HELP = (
    "commands: /clear forgets the conversation, /save FILE writes it as JSON, /exit quits; "
    'end a line with \\ to go on, or put a message between """ lines\n'
)

Message = dict[str, str]


class ChatSession:
    """The conversation and the terminal around it: `read(prompt)` returns one typed line
    (EOFError at the end of input), `write(text)` shows text."""

    def __init__(self, read: Callable[[str], str], write: Callable[[str], None],
                 system: str | None = None) -> None:
        self.read = read
        self.write = write
        self.system = system
        self.history: list[Message] = []
        self.clear()

    def clear(self) -> None:
        """Forgets every turn; the system message stays."""
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def run(self, answer: Callable[[list[Message]], str | None]) -> None:
        """Reads messages until /exit or end of input; `answer(history)` streams the reply to
        the user's last message and returns its text, or None when the turn failed (it is then
        dropped from the history)."""
        while (message := self.next_message()) is not None:
            self.history.append({"role": "user", "content": message})
            reply = answer(self.history)
            if reply is None:
                self.history.pop()
            else:
                self.history.append({"role": "assistant", "content": reply})

    def next_message(self) -> str | None:
        """The next message to send, after any commands; None to end the session."""
        while True:
            try:
                text = self._read_message()
            except EOFError:
                return None
            command, _, argument = text.strip().partition(" ")
            if not command.startswith("/") or "\n" in text.strip():
                if text.strip():
                    return text
                continue
            if command in ("/exit", "/quit"):
                return None
            if command == "/clear":
                self.clear()
                self.write("[conversation cleared]\n")
            elif command == "/save":
                self.save(argument.strip())
            elif command == "/help":
                self.write(HELP)
            else:
                self.write(f"[unknown command {command}; /help lists the commands]\n")

    def save(self, path: str) -> None:
        """Writes the history to `path` as JSON (reported, never raised)."""
        if not path:
            self.write("[usage: /save FILE]\n")
            return
        try:
            text = json.dumps(self.history, ensure_ascii=False, indent=2)
            Path(path).expanduser().write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            self.write(f"[cannot save to {path}: {exc.strerror or exc}]\n")
            return
        self.write(f"[saved {len(self.history)} messages to {path}]\n")

    def _read_message(self) -> str:
        line = self.read(PROMPT)
        if line.lstrip().startswith(BLOCK):
            return self._read_block(line.lstrip()[len(BLOCK):])
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = self.read(MORE)
        return "\n".join([*lines, line])

    def _read_block(self, first: str) -> str:
        """Lines up to one ending in the closing quotes (end of input closes it too)."""
        lines = []
        line = first
        while not line.rstrip().endswith(BLOCK):
            lines.append(line)
            try:
                line = self.read(MORE)
            except EOFError:
                return "\n".join(lines).strip("\n")
        lines.append(line.rstrip()[: -len(BLOCK)])
        return "\n".join(lines).strip("\n")
