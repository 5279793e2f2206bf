"""deepseek2 GGUF tokenizers built from the file (loading/gguf_tokenizer.py): a BPE trained here
with each known pre-tokenizer's split (DeepSeek-V3's, DeepSeek-LLM / V2's, DeepSeek-Coder's),
written into a deepseek2 GGUF with the gguf package's writer, must tokenize as the trained
tokenizer does; the llama.cpp oracle (opt-in) checks the splits against llama.cpp's own tokenizer
on the same file (llama.cpp reads the spaces inside deepseek-llm's and deepseek-coder's classes as
spaces only: `SPACES_IN_CLASSES`), and on DeepSeek's real vocabularies (llama.cpp's test files)
against the ids of DeepSeek's own tokenizers."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.gguf_tokenizer import (
    DIGITS,
    PRE_SPLITS,
    build_tokenizer,
    pre_tokenizer,
    why_not,
)

gguf = pytest.importorskip("gguf")

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
PIECES = ["Hello", " world", "1234567", "3.14159", "日本語", "のテキスト", "カタカナ", "中文字符",
          "!!", "?", "\n", "\n\n", "  ", "\t", "'s", "don't", "foo_bar", "x=1;", "émigré",
          "Ωμέγα", "😀", "—", "$100", "(a)", "<tag>", "#include", "...", "A1B2", " ", "0",
          "99999", "\r\n", "a\u0301", "/path/to", "https://x.y", "==", "->",
          # what the deepseek-llm / deepseek-coder splits tell apart: accented Latin, Greek,
          # Cyrillic, other cased scripts and letters outside deepseek-llm's cased set (ƻ ʔ ª ˆ),
          # CJK and Hangul, fullwidth and CJK punctuation, other digits, odd whitespace
          "Äpfel", " Straße", "ñandú", "Cửa Việt", " ǅemal", "ﬁ", "µ", "ƻ", "ʔ", "ª", "ˆ", "Ϳ",
          " ΐ", "ᾼ", "Ω", "K", "Привет", " мир", "Ёж", "Ꭰ", "ⰰ", "ა", "\U00010400", "\U0001e900",
          "한국어", " 텍스트", "ㄱ", "你好，世界！", "。", "、", "「引用」", "！", "？", "（全角）",
          "ＡＢＣ", "ｘｙｚ", "１２３", "‘quote’", "“dq”", "ภาษาไทย", "हिन्दी", "٣٤٥", "²", "½",
          "Ⅻ", "©", "€", "±", "→", "👍🏽", "\u00a0", "\u2003", "\u200b", "\x0b", "\x0c",
          "\u0085", "\r", " \n", "\n ", "\t\t", " \t", "   ", "\n\n\n", "x ", "  \n  ",
          "\u3000", " \u3000", "。\u3000", "\u2028", "\u202f"]
SPACES_IN_CLASSES = "".join(c for c in map(chr, range(0x800, 0x4E01)) if c.isspace())
"""The spaces inside deepseek-llm's and deepseek-coder's CJK range U+0800..U+4E00 (U+3000 is in
deepseek-llm's punctuation class too). DeepSeek's tokenizers (onig) match them there; llama.cpp
writes every non-ASCII space as \\v before it runs a regex without \\p{..} categories on
std::wregex, so it never finds them in a class and reads them as spaces only."""


def llama_cpp_reading(steps: tuple[str, ...]) -> tuple[str, ...]:
    """`steps` as llama.cpp runs them: classes of regexes without categories lose their spaces."""
    return tuple(step if step == DIGITS or "\\p{" in step else step.replace("]+", "&&\\S]+")
                 for step in steps)


def texts(count: int, seed: int, pieces: list[str] = PIECES) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
            for _ in range(count)]


def trained(pre: str = "deepseek-v3") -> Tokenizer:
    """A byte-level BPE trained with `pre`'s split on text like the tests'."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizer(pre)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts(400, 1), trainer)
    return core


def write_gguf(path: Path, core: Tokenizer, pre: str = "deepseek-v3",
               model: str = "gpt2") -> Path:
    import json

    spec = json.loads(core.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    tokens.append("<think>")  # a user-defined token: matched whole in text, not special
    types.append(4)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(SPECIALS[0]))
    writer.add_eos_token_id(tokens.index(SPECIALS[1]))
    writer.add_add_bos_token(True)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                             "{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", sorted(PRE_SPLITS))
def test_the_tokenizer_built_from_the_file_tokenizes_as_the_trained_one(tmp_path: Path,
                                                                         pre: str) -> None:
    core = trained(pre)
    g = open_gguf(write_gguf(tmp_path / "ds.gguf", core, pre=pre))
    assert why_not(g) == ""
    built = build_tokenizer(g)
    for text in texts(500, 2):
        want = core.encode(text, add_special_tokens=False).ids
        ids = built.encode(text, add_special_tokens=False)
        assert ids == want, text
        assert built.decode(ids) == text
    bos, eos = SPECIALS[0], SPECIALS[1]
    assert built.bos_token == bos and built.eos_token == eos
    assert built.encode("Hello")[0] == built.convert_tokens_to_ids(bos)  # BOS added
    special = built.encode(f"{SPECIALS[2]}hi{SPECIALS[3]}", add_special_tokens=False)
    assert special[0] == built.convert_tokens_to_ids(SPECIALS[2])  # kept whole
    assert special[-1] == built.convert_tokens_to_ids(SPECIALS[3])
    think = built.encode("a<think>b", add_special_tokens=False)
    assert built.convert_tokens_to_ids("<think>") in think
    assert built.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        f"{bos}hi")


def test_write_checkpoint_saves_it_and_unknown_splits_are_named(tmp_path: Path) -> None:
    core = trained()
    g = open_gguf(write_gguf(tmp_path / "a.gguf", core, pre="qwen2"))
    assert why_not(g) == ("tokenizer.ggml.pre is 'qwen2'; hetmoe splits text for "
                          "deepseek-coder, deepseek-llm, deepseek-v3 only")
    with pytest.raises(ValueError, match=r"a\.gguf: tokenizer\.ggml\.pre is 'qwen2'"):
        build_tokenizer(g)
    g = open_gguf(write_gguf(tmp_path / "b.gguf", core, model="llama"))
    assert why_not(g) == "tokenizer.ggml.model is 'llama', not a byte-level BPE ('gpt2')"
    from hetmoe.loading.gguf_checkpoint import _write_tokenizer

    g = open_gguf(write_gguf(tmp_path / "c.gguf", core))
    _write_tokenizer(g, tmp_path / "out")
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in texts(50, 3):
        assert saved.encode(text, add_special_tokens=False) == core.encode(
            text, add_special_tokens=False).ids


def test_the_deepseek_llm_split_is_deepseeks() -> None:
    """Pieces where DeepSeek-LLM's split differs from a plain letters / punctuation one: its ASCII
    punctuation run takes ASCII letters too (the range :-~), so it cuts a word that mixes them
    with other letters; cased letters only (ʔ is a letter, not cased); trailing whitespace leaves
    any piece; CJK punctuation is punctuation; every digit alone, fullwidth ones too."""
    split, text_of = pre_tokenizer("deepseek-llm"), decoders.ByteLevel()

    def pieces(text: str) -> list[str]:
        return [text_of.decode([piece]) for piece, _ in split.pre_tokenize_str(text)]

    assert pieces("Äpfel") == ["Ä", "pfel"]
    assert pieces(" Ωμέγα ʔa") == [" Ωμέγα", " ʔ", "a"]
    assert pieces("x=1;\n") == ["x", "=", "1", ";", "\n"]
    assert pieces("你好，世界。\u3000") == ["你好", "，", "世界", "。", "\u3000"]
    assert pieces("a  ") == ["a", "  "]
    assert pieces("１２3") == ["１", "２", "3"]


def _llama_cpp() -> tuple[type, Path]:
    """llama-cpp-python's `Llama` (built once by the llama.cpp oracle) and the sdist it was built
    from (llama.cpp's source, its test vocabularies included)."""
    from hetmoe import env
    from hetmoe.bench.llama_cpp import VERSION, ensure_llama_cpp

    home = env.cache_dir() / "oracle-llamacpp"
    ensure_llama_cpp(home)
    from llama_cpp import Llama

    return Llama, home / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"


def _mismatches(path: Path, texts_: list[str]) -> list[str]:
    """The texts whose ids from llama.cpp (vocab only) and from our tokenizer of `path` differ."""
    llama, _ = _llama_cpp()
    ours = build_tokenizer(open_gguf(path))
    theirs = llama(str(path), vocab_only=True, verbose=False)
    return [text for text in texts_
            if theirs.tokenize(text.encode(), add_bos=False, special=False) != ours.encode(
                text, add_special_tokens=False)]


def _comparable(pre: str) -> list[str]:
    """The pieces whose texts llama.cpp splits as DeepSeek's `pre` tokenizer does."""
    if pre not in ("deepseek-llm", "deepseek-coder"):
        return PIECES
    return [p for p in PIECES if not set(p) & set(SPACES_IN_CLASSES)]


@pytest.mark.oracle
@pytest.mark.parametrize("pre", sorted(PRE_SPLITS))
def test_llama_cpp_splits_text_as_we_do(tmp_path: Path, pre: str) -> None:
    """llama.cpp's tokenizer (vocab only) on the same file: the same ids for 3000 texts (without
    `SPACES_IN_CLASSES` for deepseek-llm and deepseek-coder)."""
    path = write_gguf(tmp_path / "ds.gguf", trained(pre), pre=pre)
    assert _mismatches(path, texts(3000, 4, [*_comparable(pre), "<think>"])) == []


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-coder"])
def test_llama_cpp_differs_only_on_the_spaces_inside_classes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pre: str) -> None:
    """Texts rich in `SPACES_IN_CLASSES` tokenize apart in llama.cpp, and the same once our
    classes lose their spaces as llama.cpp's do."""
    path = write_gguf(tmp_path / "ds.gguf", trained(pre), pre=pre)
    rich = texts(1000, 5, [*PIECES, *SPACES_IN_CLASSES, *SPACES_IN_CLASSES])
    assert _mismatches(path, rich) != []
    monkeypatch.setitem(PRE_SPLITS, pre, llama_cpp_reading(PRE_SPLITS[pre]))
    assert _mismatches(path, rich) == []


@pytest.mark.oracle
@pytest.mark.parametrize("pre", ["deepseek-llm", "deepseek-coder"])
def test_deepseeks_own_vocabularies_tokenize_as_deepseeks_tokenizers(tmp_path: Path,
                                                                      pre: str) -> None:
    """llama.cpp's test vocabularies of DeepSeek-LLM and DeepSeek-Coder (the real vocabularies,
    merges and added tokens, with the ids DeepSeek's own tokenizers give for llama.cpp's test
    texts, as llama.cpp's convert_hf_to_gguf_update.py wrote them): ours gives those ids, and
    llama.cpp's ids on 3000 random texts."""
    _, sdist = _llama_cpp()
    name = f"ggml-vocab-{pre}.gguf"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.endswith((f"/models/{name}", f"/models/{name}.inp",
                                       f"/models/{name}.out"))]
        assert len(members) == 3, f"{sdist.name} has no {name} with its test texts"
        for member in members:
            member.name = Path(member.name).name
            tar.extract(member, tmp_path, filter="data")
    path = tmp_path / name
    cases = (tmp_path / f"{name}.inp").read_text(encoding="utf-8").split(
        "\n__ggml_vocab_test__\n")[:-1]
    wants = (tmp_path / f"{name}.out").read_text(encoding="utf-8").split("\n")
    assert len(cases) > 40
    ours = build_tokenizer(open_gguf(path))
    for text, want in zip(cases, wants, strict=False):
        assert ours.encode(text, add_special_tokens=False) == [int(i) for i in want.split()], text
    assert _mismatches(path, texts(3000, 4, _comparable(pre))) == []
