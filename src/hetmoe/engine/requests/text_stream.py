"""Incremental detokenization with stop strings, for streaming.

Token-by-token decoding breaks multi-byte UTF-8 characters and BPE merges, so text is re-decoded
over a short window of recent tokens and released only when it no longer ends in an incomplete
character (U+FFFD). The window may start inside the prompt (`context`), so that tokenizers that
drop a leading space when a text starts with a word (SentencePiece) still give the first word
its space. Text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CONTEXT_TOKENS = 4
"""Prompt tokens a request's detokenizer window starts with (see the module docstring)."""


class TextStream:
    """Feed tokens with `push`, take safe text pieces; `finish` returns what was held back."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: Sequence[str] = (),
        context: Sequence[int] = (),
    ) -> None:
        """`decode` turns ids into text; `stop` strings end the text; `context` are the last few
        prompt tokens (their text is never released)."""
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = list(context)
        self._prefix = 0  # window start: tokens before it are settled text
        self._read = len(self._ids)  # tokens before it are already accounted for
        self.text = ""
        """All text decoded so far (cut at a stop string once one is found)."""
        self._sent = 0
        self.stopped = False
        """True once a stop string was found; push() then releases nothing more."""

    def push(self, token: int) -> str:
        """Adds one token; returns the text that became safe to show (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        settled = self._decode(self._ids[self._prefix : self._read])
        current = self._decode(self._ids[self._prefix :])
        if len(current) > len(settled) and not current.endswith("\ufffd"):
            self.text += current[len(settled) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Ends the stream: returns the held-back rest. A character whose bytes were cut off
        (generation ended inside it) is dropped, not shown as U+FFFD."""
        if not self.stopped:
            settled = self._decode(self._ids[self._prefix : self._read])
            rest = self._decode(self._ids[self._prefix :])[len(settled) :]
            self.text += rest.rstrip("\ufffd")
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped:
            hits = [i for i in (self.text.find(s) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        safe = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        piece = self.text[self._sent : max(safe, self._sent)]
        self._sent = max(safe, self._sent)
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stop), default=1)
        for size in range(min(longest - 1, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-size:]) for s in self._stop):
                return size
        return 0
