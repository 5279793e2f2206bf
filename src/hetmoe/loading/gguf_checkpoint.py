"""A MoE GGUF file as a checkpoint directory the loader opens: config.json of the HF family,
dequantized weights as safetensors shards under the family's HF names, and the tokenizer.

    write_checkpoint("Qwen3-30B-A3B-Q8_0.gguf", out_dir)   # then load_model(out_dir) / LLM(out_dir)

Every tensor the family needs is checked to be in the file before anything is written; quantized
types are dequantized by the `gguf` package (exact for Q8_0 in fp32), never by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.gguf import GGUFFile, open_gguf
from hetmoe.loading.gguf_families import gguf_config, gguf_tensors
from hetmoe.loading.gguf_tokenizer import build_tokenizer, why_not
from hetmoe.loading.progress import byte_progress
from hetmoe.loading.shards import write_shards

log = logging.getLogger(__name__)

_SHARD_BYTES = 2 << 30
_HF_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "mixtral": "MixtralForCausalLM"}
_HF_TOKENIZER_ARCHS = ("llama", "qwen2moe", "qwen3moe")
"""Architectures whose GGUF tokenizer transformers converts; others (deepseek2) are built by
`gguf_tokenizer` where it knows the file's pre-tokenizer."""


def write_checkpoint(path: str | Path, out: str | Path, *, dtype: torch.dtype = torch.float32,
                     progress: bool = True) -> Path:
    """Writes the GGUF at `path` into the directory `out` (created) as a HF checkpoint of its
    family, weights in `dtype`; returns `out`. CheckpointError names the file and the field or
    tensor that is missing or unsupported."""
    g = open_gguf(path)
    out = Path(out)
    config = gguf_config(g)
    check_complete(g, config)
    config.dtype = dtype
    config.architectures = [_HF_CLASSES[config.model_type]]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    total = sum(int(t.n_bytes) for t in g.reader.tensors)
    with byte_progress(total, f"converting {g.path.name}", progress) as advance:
        write_shards(out, _cast(gguf_tensors(g, config), dtype, _counted(g, advance)),
                     _SHARD_BYTES)
    _write_tokenizer(g, out)
    return out


def _counted(g: GGUFFile, advance: Callable[[int], None]) -> Callable[[str], None]:
    sizes = {t.name: int(t.n_bytes) for t in g.reader.tensors}
    return lambda name: advance(sizes.get(name, 0))


def _cast(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
          seen: Callable[[str], None]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        seen(name)
        yield name, tensor.to(dtype)


def _write_tokenizer(g: GGUFFile, out: Path) -> None:
    if g.arch in _HF_TOKENIZER_ARCHS:
        tokenizer = AutoTokenizer.from_pretrained(str(g.path.parent), gguf_file=g.path.name)
    else:
        problem = why_not(g)
        if problem:
            log.warning("%s: no tokenizer for this %s GGUF (%s); %s has none (token ids in "
                        "and out only)", g.path, g.arch, problem, out)
            return
        tokenizer = build_tokenizer(g)
    tokenizer.save_pretrained(out)


def check_complete(g: GGUFFile, config: Any) -> None:
    """Raises CheckpointError naming the first tensor the family needs that the file lacks."""
    names = {t.name for t in g.reader.tensors}
    need = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_word_embeddings:
        need.append("output.weight")
    for layer in range(config.num_hidden_layers):
        need += [f"blk.{layer}.{part}.weight" for part in _layer_parts(g.arch, config, layer)]
    for name in need:
        if name not in names and not _has_alternative(name, names):
            raise CheckpointError(f"{g.path}: tensor {name!r} is missing ({g.arch}, "
                                  f"{config.num_hidden_layers} layers)")


def _layer_parts(arch: str, config: Any, layer: int) -> list[str]:
    parts = ["attn_norm", "ffn_norm", "attn_output"]
    if arch == "deepseek2":
        parts += ["attn_kv_a_mqa", "attn_kv_a_norm", "attn_kv_b"]
        parts += ["attn_q"] if config.q_lora_rank is None else ["attn_q_a", "attn_q_a_norm",
                                                                "attn_q_b"]
        if layer < config.first_k_dense_replace:
            return parts + ["ffn_gate", "ffn_up", "ffn_down"]
        if config.n_shared_experts:
            parts += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    else:
        parts += ["attn_q", "attn_k", "attn_v"]
        parts += ["attn_q_norm", "attn_k_norm"] if arch == "qwen3moe" else []
        parts += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
                  "ffn_gate_inp_shexp"] if arch == "qwen2moe" else []
    return parts + ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]


def _has_alternative(name: str, names: set[str]) -> bool:
    """Other spellings llama.cpp has used: split MLA `attn_k_b` + `attn_v_b` for `attn_kv_b`,
    one tensor per expert (`ffn_gate.0`, ...) for fused `ffn_gate_exps`."""
    base = name.removesuffix(".weight")
    if base.endswith("attn_kv_b"):
        stem = base.removesuffix("attn_kv_b")
        return {f"{stem}attn_k_b.weight", f"{stem}attn_v_b.weight"} <= names
    if base.endswith("_exps"):
        return f"{base.removesuffix('_exps')}.0.weight" in names
    return False
