"""Streaming text: whole UTF-8 characters only, stop strings held back and cut."""

from __future__ import annotations

from hetmoe.engine.requests.text_stream import TextStream

TEXT = "héllo → 世界 ✓ done"


def byte_decode(ids: list[int]) -> str:
    """One token per byte, like a byte-level tokenizer without merges."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_are_never_split() -> None:
    stream = TextStream(byte_decode)
    pieces = [stream.push(b) for b in TEXT.encode()]
    pieces.append(stream.finish())
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert "世" in pieces  # released as soon as its third byte arrived


def test_real_tokenizer_pieces(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    ids = llm.encode(TEXT)[1:]  # drop <s>
    stream = TextStream(llm.decode)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == TEXT and not any("\ufffd" in p for p in pieces)


def test_stop_string_is_held_back_then_cut() -> None:
    stream = TextStream(byte_decode, stop=["wor", "xyz"])
    out = [stream.push(b) for b in b"hello w"]
    assert "".join(out) == "hello "  # "w" may start "wor": held back
    assert stream.push(ord("o")) == "" and not stream.stopped
    assert stream.push(ord("r")) == "" and stream.stopped
    assert stream.text == "hello " and stream.finish() == ""
    assert stream.push(ord("!")) == ""


def test_held_back_text_is_released_when_it_cannot_stop() -> None:
    stream = TextStream(byte_decode, stop=["wor"])
    assert "".join(stream.push(b) for b in b"a w") == "a "
    assert stream.push(ord("a")) == "wa"
    assert stream.push(ord("w")) == ""
    assert stream.finish() == "w"
    assert stream.text == "a waw" and not stream.stopped


def test_context_keeps_the_first_words_space() -> None:
    words = {1: "Hello", 2: " world", 3: " again"}

    def sentencepiece_like(ids: list[int]) -> str:
        return "".join(words[i] for i in ids).lstrip(" ")  # drops the text's leading space

    alone = TextStream(sentencepiece_like)
    assert [alone.push(2), alone.push(3)] == ["world", " again"]  # the space is lost
    stream = TextStream(sentencepiece_like, context=[1])
    assert [stream.push(2), stream.push(3), stream.finish()] == [" world", " again", ""]
    assert stream.text == " world again"


def test_a_character_cut_by_the_end_is_dropped_not_shown_as_a_replacement() -> None:
    stream = TextStream(byte_decode)
    cut = "ok 世".encode()[:-1]  # generation ended after two of the three bytes of 世
    pieces = [stream.push(b) for b in cut] + [stream.finish()]
    assert "".join(pieces) == "ok " and stream.text == "ok "
    assert not any("\ufffd" in p for p in pieces)
