"""The logprobs' token bytes (`TokenText`) and constrained decoding's alphabet (`token_bytes`)
spell every token alike: one rule, engine/requests/token_bytes.py `TokenSpelling`."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from transformers import AutoTokenizer

from hetmoe.engine.requests.token_bytes import token_bytes
from hetmoe.server.logprobs import TokenText


def _ids_to_bytes(tokenizer: object, vocab_size: int) -> dict[int, bytes]:
    return {i: raw for raw, ids in token_bytes(tokenizer, vocab_size).items() for i in ids}


def test_logprobs_and_constraints_spell_a_byte_level_vocabulary_alike(tiny_qwen3_moe) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    spelled = _ids_to_bytes(tokenizer, len(tokenizer))
    text = TokenText(tokenizer, tokenizer.decode, threading.Lock())
    assert len(spelled) > 100
    assert all(text(i)[1] == raw for i, raw in spelled.items())
    assert text(tokenizer.convert_tokens_to_ids("Ġthe"))[1] == b" the"


def test_sentencepiece_bytes_and_the_decode_fallback() -> None:
    vocab = {"<s>": 0, "▁a": 1, "<0x0A>": 2, "b▁": 3, "<0x7B>": 4}
    by_id = {i: t for t, i in vocab.items()}
    tokenizer = SimpleNamespace(get_vocab=lambda: vocab, all_special_ids=[0],
                                added_tokens_decoder={},
                                convert_ids_to_tokens=lambda i: by_id.get(i))
    text = TokenText(tokenizer, lambda ids: f"<{ids[0]}>", threading.Lock())
    assert [text(i)[1] for i in range(1, 5)] == [b" a", b"\n", b"b ", b"{"]
    assert all(text(i)[1] == raw for i, raw in _ids_to_bytes(tokenizer, 5).items())
    assert text(9) == ("<9>", b"<9>")  # no vocabulary string: the tokenizer's decoding
