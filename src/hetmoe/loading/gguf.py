"""A GGUF file opened for reading: metadata, tensors dequantized by the `gguf` package, and (for
dense llama files, the demo's source) HF names, config and the tokenizer as a `tokenizers` object.

MoE architectures are mapped to their HF family in `gguf_families.py`. Anything unsupported fails
with a message naming the file and the field or tensor, never with a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.gguf_check import truncated_tensor
from hetmoe.loading.gguf_split import open_reader

ARCHITECTURES = ("deepseek2", "llama", "qwen2moe", "qwen3moe")
"""`general.architecture` values read here (llama with `expert_count`: Mixtral)."""

# GGUF tensor name (after `blk.N.`) -> HF module path (after `model.layers.N.`).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_CONTROL_TOKEN = 3  # llama.cpp token type of special tokens (<|im_start|> and friends)
# Pre-tokenizers by `tokenizer.ggml.pre`: each splits digits one by one before GPT-2 byte-level BPE.
_DIGIT_SPLITTING_PRE = ("smollm",)


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file opened for reading (tensors stay memory-mapped until read)."""

    path: Path
    """The .gguf file."""
    metadata: dict[str, Any]
    """Every key/value field, decoded to Python values (token lists included)."""
    reader: Any = dataclasses.field(repr=False, compare=False)
    """The open `gguf.GGUFReader`, or a `SplitReader` over a split's parts (parsing the header
    again costs seconds: 49k token strings)."""

    def field(self, key: str) -> Any:
        """The metadata value at `key`; a clear error naming the file when it is absent."""
        if key not in self.metadata:
            raise KeyError(f"{self.path}: GGUF field {key!r} is missing")
        return self.metadata[key]

    @property
    def arch(self) -> str:
        """`general.architecture`."""
        return str(self.field("general.architecture"))

    def arch_field(self, key: str, default: Any = KeyError) -> Any:
        """The field `<arch>.<key>`; `default` when absent, else a KeyError naming the file."""
        full = f"{self.arch}.{key}"
        if full not in self.metadata and default is not KeyError:
            return default
        return self.field(full)

    def read(self, tensor: Any) -> torch.Tensor:
        """One `reader.tensors` entry as an fp32 tensor in HF (row-major, numpy) order: quantized
        blocks dequantized by `gguf.quants.dequantize`; a type it lacks is named with the file."""
        # gguf is optional: the `demo` extra (pip install 'hetmoe[demo]')
        from gguf.quants import dequantize

        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name!r} has quantization type "
                f"{tensor.tensor_type.name}, which the gguf package cannot dequantize ({exc})"
            ) from None
        # A copy: F32 tensors come back as read-only views of the memory map.
        return torch.from_numpy(np.array(array, dtype=np.float32))

    def llama_config(self) -> dict[str, Any]:
        """HF `LlamaConfig` fields equivalent to the GGUF hyper-parameters."""
        heads = int(self.field("llama.attention.head_count"))
        hidden = int(self.field("llama.embedding_length"))
        head_dim = int(self.metadata.get("llama.rope.dimension_count", hidden // heads))
        if head_dim * heads != hidden:
            raise ValueError(
                f"{self.path}: rope dimension {head_dim} x {heads} heads != hidden {hidden}; "
                "partial rotary embeddings are not supported"
            )
        return {
            "vocab_size": len(self.field("tokenizer.ggml.tokens")),
            "hidden_size": hidden,
            "intermediate_size": int(self.field("llama.feed_forward_length")),
            "num_hidden_layers": int(self.field("llama.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.metadata.get("llama.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "max_position_embeddings": int(self.field("llama.context_length")),
            "rms_norm_eps": float(self.field("llama.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.metadata.get("llama.rope.freq_base", 10000.0)),
            "bos_token_id": int(self.field("tokenizer.ggml.bos_token_id")),
            "eos_token_id": int(self.field("tokenizer.ggml.eos_token_id")),
            "pad_token_id": self.metadata.get("tokenizer.ggml.padding_token_id"),
        }

    def llama_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor in HF layout) for every tensor of a dense llama file; quantized
        blocks are dequantized and llama.cpp's rotary row order of q/k is undone."""
        config = self.llama_config()
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for tensor in self.reader.tensors:
            name = _hf_name(self.path, tensor.name)
            weight = self.read(tensor)  # [out, in], HF order
            if name.endswith("q_proj.weight"):
                weight = unpermute_rotary_rows(weight, heads)
            elif name.endswith("k_proj.weight"):
                weight = unpermute_rotary_rows(weight, kv_heads)
            yield name, weight

    def tokenizer(self) -> Tokenizer:
        """The byte-level BPE tokenizer described by the `tokenizer.ggml.*` fields."""
        kind, pre = self.field("tokenizer.ggml.model"), self.metadata.get("tokenizer.ggml.pre")
        if kind != "gpt2" or pre not in _DIGIT_SPLITTING_PRE:
            raise ValueError(
                f"{self.path}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                f"(expected 'gpt2' with one of {_DIGIT_SPLITTING_PRE})"
            )
        tokens: list[str] = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        vocab = {token: i for i, token in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        types = self.field("tokenizer.ggml.token_type")
        special = [tokens[i] for i, t in enumerate(types) if t == _CONTROL_TOKEN]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        return tok


def open_gguf(path: str | Path) -> GGUFFile:
    """Reads the metadata of a GGUF file of one of `ARCHITECTURES` (tensors are read lazily)."""
    path = Path(path)
    try:
        reader = open_reader(path)  # part 1 of a split: all its parts
    except CheckpointError:  # a split's part missing or not the first, named already
        raise
    except (ValueError, OSError) as exc:
        raise CheckpointError(truncated_tensor(path)
                              or f"{path}: not a readable GGUF file ({exc})") from None
    metadata = {key: value.contents() for key, value in reader.fields.items()}
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture is {arch!r}, expected one of "
                              f"{', '.join(repr(a) for a in ARCHITECTURES)}")
    return GGUFFile(path=path, metadata=metadata, reader=reader)


def _hf_name(path: Path, gguf_name: str) -> str:
    match = _BLOCK.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"{path}: tensor {gguf_name!r} has no HF name in the llama name map")


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each head's q/k rows interleaved (pairs for its rotary kernel); HF keeps
    the two rotary halves apart. [heads*D, H] -> same shape, rows reordered per head."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()
