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


class TokenSpelling:
    """How one tokenizer spells its vocabulary strings as bytes (its decoder read once): the one
    rule behind constrained decoding's alphabet (`token_bytes`) and the logprobs' exact bytes
    (server/logprobs.py)."""

    def __init__(self, tokenizer: Any) -> None:
        kinds = decoder_kinds(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        """Byte-level BPE: each character stands for one byte."""
        self.fallback = "ByteFallback" in kinds or not kinds
        """`<0xNN>` tokens stand for byte NN (SentencePiece's byte fallback)."""
        self.literal = {getattr(t, "content", str(t))
                        for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        """Added tokens: literal text."""

    def __call__(self, text: str) -> bytes | None:
        """The bytes of vocabulary string `text` (None: not spelled in the decoder's alphabet)."""
        if text in self.literal:
            return text.encode()
        if self.byte_level:
            try:
                return bytes(_BYTE_OF[c] for c in text)
            except KeyError:
                return None
        byte = _BYTE_FALLBACK.fullmatch(text) if self.fallback else None
        if byte:
            return bytes([int(byte.group(1), 16)])
        return text.replace("\u2581", " ").encode()  # SentencePiece's word boundary


def token_bytes(tokenizer: Any, vocab_size: int,
                skip: Iterable[int] = ()) -> dict[bytes, list[int]]:
    """bytes -> token ids of every ordinary token below `vocab_size` (the logits' width),
    leaving out special tokens, `skip` and tokens whose spelling is not in the decoder's
    alphabet (those are never allowed under a constraint)."""
    spell = TokenSpelling(tokenizer)
    left_out = special_ids(tokenizer, skip)
    found: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id in left_out or not 0 <= token_id < vocab_size:
            continue
        spelled = spell(text)
        if spelled:
            found.setdefault(spelled, []).append(token_id)
    return found
