"""The bytes each token of a Hugging Face tokenizer stands for (what constrained decoding matches).

A tokenizer's vocabulary holds token *strings* in its own encoding: byte-level BPE (GPT-2, Llama 3,
Qwen, SmolLM) spells each byte as a printable character (`Ġ` for a space), SentencePiece spells a
space as `▁` and unknown bytes as `<0x0A>`. The tokenizer.json decoder says which; added tokens are
literal text. Special tokens (and the model's end-of-sequence ids) stand for no text and are left
out: constrained decoding allows them only where it means to (EOS in a final state).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (tokenizers' `ByteLevel`), character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_level_alphabet()


def decoder_kinds(tokenizer: Any) -> set[str]:
    """Types of the fast tokenizer's decoder and its parts (`ByteLevel`, `ByteFallback`,
    `Metaspace`, `Replace`, ...); empty for a tokenizer without tokenizer.json."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = [decoder, *decoder.get("decoders", ())]
    return {str(p.get("type")) for p in parts if isinstance(p, dict)}


def special_ids(tokenizer: Any, extra: Iterable[int] = ()) -> set[int]:
    """Ids of the tokenizer's special tokens (added tokens marked special included) and
    `extra` (the model's EOS ids)."""
    ids = set(getattr(tokenizer, "all_special_ids", ())) | set(extra)
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids


def token_bytes(tokenizer: Any, vocab_size: int,
                skip: Iterable[int] = ()) -> dict[bytes, list[int]]:
    """bytes -> token ids of every ordinary token below `vocab_size` (the logits' width),
    leaving out special tokens, `skip` and tokens whose spelling is not in the decoder's
    alphabet (those are never allowed under a constraint)."""
    kinds = decoder_kinds(tokenizer)
    byte_level = "ByteLevel" in kinds
    fallback = "ByteFallback" in kinds or not kinds
    left_out = special_ids(tokenizer, skip)
    literal = {getattr(t, "content", str(t))
               for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    found: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id in left_out or not 0 <= token_id < vocab_size:
            continue
        spelled = _spelled(text, text in literal, byte_level, fallback)
        if spelled:
            found.setdefault(spelled, []).append(token_id)
    return found


def _spelled(text: str, literal: bool, byte_level: bool, fallback: bool) -> bytes | None:
    """One token's bytes (None: not spelled in the decoder's alphabet)."""
    if literal:
        return text.encode()
    if byte_level:
        try:
            return bytes(_BYTE_OF[c] for c in text)
        except KeyError:
            return None
    byte = _BYTE_FALLBACK.fullmatch(text) if fallback else None
    if byte:
        return bytes([int(byte.group(1), 16)])
    return text.replace("▁", " ").encode()
