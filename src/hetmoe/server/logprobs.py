"""Log-probabilities in OpenAI's shapes: chat `ChoiceLogprobs` and completions `Logprobs`.

Each token is shown as its text and its exact bytes, spelled as constrained decoding spells it
(engine/requests/token_bytes.py `TokenSpelling`: byte-level BPE characters as their bytes, a
SentencePiece byte token `<0xNN>` as that byte, added tokens as their text); a token outside its
decoder's alphabet is the tokenizer's decoding of it alone. A token that holds part of a character
shows U+FFFD in `token`, its bytes in `bytes`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from hetmoe.engine.requests.logprobs import TokenLogprob
from hetmoe.engine.requests.token_bytes import TokenSpelling


class TokenText:
    """Token id -> (text, bytes), cached; thread-safe through the tokenizer's lock."""

    def __init__(self, tokenizer: Any, decode: Callable[[list[int]], str],
                 lock: threading.Lock) -> None:
        """`decode`: ids -> text (the fallback for tokens of no known kind)."""
        self._tokenizer = tokenizer
        self._decode = decode
        self._lock = lock
        self._spell = None if tokenizer is None else TokenSpelling(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """The token's text (U+FFFD where it holds part of a character) and exact bytes."""
        known = self._cache.get(token_id)
        if known is None:
            with self._lock:
                raw = self._bytes(token_id)
            known = (raw.decode("utf-8", errors="replace"), raw)
            self._cache[token_id] = known
        return known

    def label(self, token_id: int) -> str:
        """The token as completions show it: its text, or `bytes:\\xNN...` when its bytes are
        not whole UTF-8 characters (as OpenAI's; distinct tokens stay distinct keys)."""
        token, raw = self(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _bytes(self, token_id: int) -> bytes:
        piece = None if self._spell is None else self._tokenizer.convert_ids_to_tokens(token_id)
        spelled = self._spell(piece) if self._spell is not None and isinstance(piece, str) else None
        return self._decode([token_id]).encode() if spelled is None else spelled


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """A chat choice's `logprobs`: {"content": [ChatCompletionTokenLogprob], "refusal": None}."""
    content = []
    for entry in entries:
        token, raw = text(entry.token_id)
        top = []
        for alt_id, alt_logprob in entry.top:
            alt, alt_raw = text(alt_id)
            top.append({"token": alt, "bytes": list(alt_raw), "logprob": alt_logprob})
        content.append({"token": token, "bytes": list(raw), "logprob": entry.logprob,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                        text: TokenText, offset: int = 0) -> dict[str, Any]:
    """A completion choice's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) for
    `token_ids`, whose entries may be None (an echoed prompt's first token: no score); offsets
    count characters from `offset` (a partial character counts as one). As OpenAI's, each
    top_logprobs holds the chosen token too (up to logprobs + 1 entries)."""
    tokens: list[str] = []
    scores: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text.label(token_id)
        offsets.append(offset)
        offset += len(text(token_id)[0])
        tokens.append(token)
        scores.append(None if entry is None else entry.logprob)
        if entry is None:
            tops.append(None)
        else:
            top = {text.label(t): v for t, v in entry.top}
            top.setdefault(token, entry.logprob)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": scores, "top_logprobs": tops,
            "text_offset": offsets}
