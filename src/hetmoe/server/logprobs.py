"""Log-probabilities in OpenAI's shapes: chat `ChoiceLogprobs` and completions `Logprobs`.

Each token is shown as its text and its exact bytes: a byte-level BPE token (GPT-2, Qwen,
SmolLM, ...) maps its characters back to bytes through the byte-to-character table those
tokenizers share; a SentencePiece byte token `<0xNN>` is that byte; special and other tokens
are their UTF-8 text. A token that holds part of a character shows U+FFFD in `token`, its
bytes in `bytes`.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hetmoe.engine.logprobs import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_table() -> dict[str, int]:
    """Character -> byte of byte-level BPE: printable bytes stand for themselves, the other 68
    bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """Token id -> (text, bytes), cached; thread-safe through the tokenizer's lock."""

    def __init__(self, tokenizer: Any, decode: Callable[[list[int]], str],
                 lock: threading.Lock) -> None:
        """`decode`: ids -> text (the fallback for tokens of no known kind)."""
        self._tokenizer = tokenizer
        self._decode = decode
        self._lock = lock
        self._byte_level = tokenizer is not None and _decoder_type(tokenizer) == "ByteLevel"
        self._special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
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
        if self._tokenizer is None:
            return self._decode([token_id]).encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return self._decode([token_id]).encode()
        if token_id in self._special:
            return piece.encode()
        table = byte_level_table()
        if self._byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece's word boundary
            return piece.replace("\u2581", " ").encode()
        return self._decode([token_id]).encode()


def _decoder_type(tokenizer: Any) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return None if decoder is None else type(decoder).__name__


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
