"""DeepSeek-V3 GGUF tokenizers built from the file (loading/gguf_tokenizer.py): a BPE trained
here with DeepSeek-V3's pre-tokenizer, written into a deepseek2 GGUF with the gguf package's
writer, must tokenize as the trained tokenizer does; the llama.cpp oracle (opt-in) checks the
splits against llama.cpp's own tokenizer on the same file."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.gguf_tokenizer import PRE_SPLITS, build_tokenizer, why_not

gguf = pytest.importorskip("gguf")

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
PIECES = ["Hello", " world", "1234567", "3.14159", "日本語", "のテキスト", "カタカナ", "中文字符",
          "!!", "?", "\n", "\n\n", "  ", "\t", "'s", "don't", "foo_bar", "x=1;", "émigré",
          "Ωμέγα", "😀", "—", "$100", "(a)", "<tag>", "#include", "...", "A1B2", " ", "0",
          "99999", "\r\n", "a\u0301", "/path/to", "https://x.y", "==", "->"]


def texts(count: int, seed: int, pieces: list[str] = PIECES) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
            for _ in range(count)]


def trained() -> Tokenizer:
    """A byte-level BPE trained with DeepSeek-V3's pre-tokenizer on text like the tests'."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS["deepseek-v3"]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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


def test_the_tokenizer_built_from_the_file_tokenizes_as_the_trained_one(tmp_path: Path) -> None:
    core = trained()
    g = open_gguf(write_gguf(tmp_path / "ds.gguf", core))
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
    g = open_gguf(write_gguf(tmp_path / "a.gguf", core, pre="deepseek-llm"))
    assert why_not(g) == ("tokenizer.ggml.pre is 'deepseek-llm'; hetmoe splits text for "
                          "deepseek-v3 only")
    with pytest.raises(ValueError, match=r"a\.gguf: tokenizer\.ggml\.pre is 'deepseek-llm'"):
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


@pytest.mark.oracle
def test_llama_cpp_splits_deepseek_v3_text_as_we_do(tmp_path: Path) -> None:
    """llama.cpp's tokenizer (vocab only) on the same file: the same ids for 3000 texts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from oracle_llamacpp import ensure_llama_cpp

    from hetmoe import env

    ensure_llama_cpp(env.cache_dir() / "oracle-llamacpp")
    from llama_cpp import Llama

    path = write_gguf(tmp_path / "ds.gguf", trained())
    ours = build_tokenizer(open_gguf(path))
    theirs = Llama(str(path), vocab_only=True, verbose=False)
    for text in texts(3000, 4, [*PIECES, "<think>"]):
        assert theirs.tokenize(text.encode(), add_bos=False, special=False) == ours.encode(
            text, add_special_tokens=False), text
