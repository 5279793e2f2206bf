"""The tokenizer of a GGUF whose tokenizer transformers does not convert (`deepseek2` files:
DeepSeek-V3 / R1 / V3.1 with the `deepseek-v3` pre-tokenizer, DeepSeek-V2 / V2-Lite / DeepSeek-LLM
with `deepseek-llm`, DeepSeek-Coder with `deepseek-coder`), built with the `tokenizers` library from
the file's own vocabulary, merges and token types.

A byte-level BPE's merges only reproduce the model's tokens when the text is split the way they
were learned; the split is named by `tokenizer.ggml.pre`, and only the splits written here are
built: each is the `pre_tokenizer` of the model's own tokenizer.json, step by step. Checked against
llama.cpp's tokenizer on the same file (tests/loading/test_gguf_tokenizer.py and its llama.cpp
oracle).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from hetmoe.loading.gguf import GGUFFile

DIGITS = "Digits(individual_digits=True)"
r"""A step that is no regex: `tokenizers`' Digits pre-tokenizer, every digit a piece of its own (as
`\p{N}` isolated, but with the Unicode tables of Rust's `char::is_numeric`), as the model's own
tokenizer.json has it. llama.cpp splits deepseek-llm's digits in runs (`\p{N}+`): the same ids,
DeepSeek's vocabularies having no token of two digits."""

_CASED_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
"""The letters of deepseek-llm's word split: cased letters (Lu, Ll, Lt) only, of Latin, Greek,
Cyrillic, Armenian, Georgian, Cherokee, Glagolitic, Coptic, Deseret, Osage, Old Hungarian, Warang
Citi, Adlam, letterlike symbols and fullwidth A-Z a-z. Written as escapes: some (U+1F7D, U+1FBE,
U+1FD3, U+1FDB, U+2126, U+212A) have canonical equivalents that normalizing the source would
swap in."""

_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
"""deepseek-llm's and deepseek-coder's run of CJK ideographs, of U+0800..U+4E00 (kana, Indic,
Thai, CJK punctuation and some spaces among them) and of Hangul syllables. llama.cpp never matches
a space against a class like this one (it writes non-ASCII spaces as \\v first), so U+2000..U+200A,
U+3000 and the like fall outside its runs; here they are inside, as in DeepSeek's tokenizers."""

PRE_SPLITS: dict[str, tuple[str, ...]] = {
    # DeepSeek-V3's tokenizer.json: digits in runs of at most three, CJK runs, then words,
    # punctuation and whitespace.
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # DeepSeek-LLM's tokenizer.json (V2 / V2-Lite GGUFs carry its name: llama.cpp's converter
    # names a split by the ids it gives a check text): every CR and LF alone, a space and a run of
    # cased letters, a space and a run of ASCII, fullwidth or CJK punctuation (the ASCII range :-~
    # holds A-Z a-z too), trailing whitespace, CJK / Hangul runs, digits one by one.
    "deepseek-llm": (
        "[\r\n]",
        r"\s?[" + _CASED_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        DIGITS,
    ),
    # DeepSeek-Coder's tokenizer.json: every CR and LF alone, a space and a run of letters, a space
    # and a run of punctuation, CJK / Hangul runs, digits one by one.
    "deepseek-coder": (
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        _CJK_HANGUL,
        DIGITS,
    ),
}
"""`tokenizer.ggml.pre` -> the steps that split text before byte-level BPE, in order: regexes
(each match a piece, the text between matches pieces too) or `DIGITS`."""

CONTROL, USER_DEFINED = 3, 4
"""llama.cpp token types: special tokens, and added tokens matched whole in text."""


def why_not(g: GGUFFile) -> str:
    """Why `build_tokenizer` cannot build this file's tokenizer ("" when it can)."""
    model = g.metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        return f"tokenizer.ggml.model is {model!r}, not a byte-level BPE ('gpt2')"
    pre = g.metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_SPLITS:
        return (f"tokenizer.ggml.pre is {pre!r}; hetmoe splits text for "
                f"{', '.join(sorted(PRE_SPLITS))} only")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in g.metadata:
            return f"GGUF field {key!r} is missing"
    return ""


def pre_tokenizer(pre: str) -> Any:
    """The `tokenizers` pre-tokenizer of `PRE_SPLITS[pre]`: its steps in order, then the byte-level
    mapping (no regex of its own)."""
    steps = [pre_tokenizers.Digits(individual_digits=True) if step == DIGITS
             else pre_tokenizers.Split(Regex(step), behavior="isolated")
             for step in PRE_SPLITS[pre]]
    return pre_tokenizers.Sequence(
        [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def build_tokenizer(g: GGUFFile) -> Any:
    """The file's tokenizer as a transformers `PreTrainedTokenizerFast` (BOS added when the file
    says so, its chat template kept). ValueError (`why_not`) when it cannot be built."""
    problem = why_not(g)
    if problem:
        raise ValueError(f"{g.path}: {problem}")
    tokens = [str(t) for t in g.field("tokenizer.ggml.tokens")]
    merges = [_pair(str(m)) for m in g.field("tokenizer.ggml.merges")]
    types = [int(t) for t in g.metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    core.pre_tokenizer = pre_tokenizer(str(g.field("tokenizer.ggml.pre")))
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    core.add_tokens([AddedToken(t, special=False, normalized=False)
                     for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])
    named = {}
    for name in ("bos", "eos", "padding", "unknown"):
        token_id = g.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            named[name] = tokens[int(token_id)]
    bos = named.get("bos")
    if bos is not None and bool(g.metadata.get("tokenizer.ggml.add_bos_token", False)):
        bos_id = tokens.index(bos)
        core.post_processor = TemplateProcessing(single=f"{bos}:0 $A:0",
                                                 pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                 special_tokens=[(bos, bos_id)])
    template = g.metadata.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=bos, eos_token=named.get("eos"),
        pad_token=named.get("padding"), unk_token=named.get("unknown"),
        chat_template=str(template) if template is not None else None)
