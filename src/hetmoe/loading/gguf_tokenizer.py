"""The tokenizer of a GGUF whose tokenizer transformers does not convert (DeepSeek-V3 / R1 / V3.1
GGUFs: `deepseek2` files with the `deepseek-v3` pre-tokenizer), built with the `tokenizers`
library from the file's own vocabulary, merges and token types.

A byte-level BPE's merges only reproduce the model's tokens when the text is split the way they
were learned; the split is named by `tokenizer.ggml.pre`, and only the splits written here are
built (they are DeepSeek-V3's pre-tokenizer: digits in runs of at most three, CJK runs, then
words, punctuation and whitespace). Checked against llama.cpp's tokenizer on the same file
(tests/loading/test_gguf_tokenizer.py and its llama.cpp oracle).
"""

from __future__ import annotations

from typing import Any

from hetmoe.loading.gguf import GGUFFile

PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[一-龥\u3040-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
"""`tokenizer.ggml.pre` -> the regexes that split text before byte-level BPE, in order."""

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


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def build_tokenizer(g: GGUFFile) -> Any:
    """The file's tokenizer as a transformers `PreTrainedTokenizerFast` (BOS added when the file
    says so, its chat template kept). ValueError (`why_not`) when it cannot be built."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    problem = why_not(g)
    if problem:
        raise ValueError(f"{g.path}: {problem}")
    tokens = [str(t) for t in g.field("tokenizer.ggml.tokens")]
    merges = [_pair(str(m)) for m in g.field("tokenizer.ggml.merges")]
    types = [int(t) for t in g.metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated")
         for r in PRE_SPLITS[g.field("tokenizer.ggml.pre")]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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
