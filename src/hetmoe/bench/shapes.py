"""Real model shapes for `hetmoe bench --random-weights SHAPE`: the published configs' sizes.

Only what sets the work per token is kept (widths, heads, expert counts, top-k, routing method);
rope scaling is plain, since positions do not change the speed.
"""

from __future__ import annotations

import argparse
from typing import Any

from transformers import AutoConfig

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )),
    "deepseek-v2-lite": ("deepseek_v2", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, scoring_func="softmax", kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )),
    "deepseek-v3-few-layers": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=4,
        num_attention_heads=128, num_key_value_heads=128, moe_intermediate_size=2048,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=1,
        routed_scaling_factor=2.5, topk_method="noaux_tc", n_group=8, topk_group=4,
        norm_topk_prob=True, scoring_func="sigmoid", kv_lora_rank=512, q_lora_rank=1536,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
}
"""Shape name -> (model_type, transformers config fields)."""


def _shape(name: str) -> tuple[str, dict[str, Any]]:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}")
    return SHAPES[name]


def shape_config(name: str, num_layers: int | None = None) -> Any:
    """The transformers config of shape `name` (optionally with fewer decoder layers)."""
    model_type, fields = _shape(name)
    if num_layers is not None:
        fields = {**fields, "num_hidden_layers": num_layers}
    return AutoConfig.for_model(model_type, **fields)


def routed_expert_shape(name: str) -> tuple[int, int, int, int]:
    """(routed experts, hidden size, expert width, experts per token) of shape `name`."""
    f = _shape(name)[1]
    experts = f.get("num_experts") or f.get("n_routed_experts") or f["num_local_experts"]
    intermediate = f.get("moe_intermediate_size", f["intermediate_size"])
    return experts, f["hidden_size"], intermediate, f["num_experts_per_tok"]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a profiling script's random-weight model: --shape, --weight-format of the
    routed experts, --num-layers (default: the shape's), --deferred (comma-separated values)."""
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--weight-format", default="bf16")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--deferred", default="0,3")
