"""The module path's decoder layer: HF's pre-norm layer run over the math the fused decode step
calls (ops/fused.py), so the two paths differ only in being compiled or not.

HF writes the layer of every supported family (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3;
transformers 5.17 to 5.24) as the same steps:

    h += attention(norm(h)); h += mlp(norm(h))

`decoder_layer` runs those steps with the norms as `fused.rms_norm` (ops/norm.py) and the MLP's
residual add as `fused.residual` of the MoE layer's `fused.sum_terms`: the functions, in order,
that the fused step runs (engine/executor/fused_decode.py), with the same ops as HF's code. The
attention and MLP stay modules (injected ops, HF's dense MLPs), so LoRA adapters on their
projections apply. HF's own forward (training, `generate`) still runs HF's layers.
"""

from __future__ import annotations

from typing import Any

import torch

from hetmoe.ops.fused import residual
from hetmoe.ops.kv_batch import KVBatch, RaggedKV
from hetmoe.ops.norm import apply_norm
from hetmoe.ops.rope import RotaryEmbedding


def decoder_layer(layer: Any, hidden: torch.Tensor, rotary: RotaryEmbedding,
                  kv: KVBatch | RaggedKV) -> torch.Tensor:
    """One HF decoder layer (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`)
    on hidden [B, S, H] (a `RaggedKV`'s [1, T, H]) -> [B, S, H]; rotary: HF's rotary output for
    `kv.positions`."""
    x = apply_norm(layer.input_layernorm, hidden)
    attn, _ = layer.self_attn(x, rotary, kv=kv)
    hidden = hidden + attn
    x = apply_norm(layer.post_attention_layernorm, hidden)
    # HybridMoE sums its terms with `fused.sum_terms` (ops/moe_step.py): h + that sum is the
    # fused step's `residual` over the terms. The MLP is called as a module, so hooks run.
    return residual(hidden, (layer.mlp(x),))


def decoder_stack(base: Any, hidden: torch.Tensor, rotary: RotaryEmbedding,
                  kv: KVBatch | RaggedKV) -> torch.Tensor:
    """Every decoder layer of HF's base model `base` (`layers`, `norm`) on the embedded hidden
    [B, S, H], then the final norm -> [B, S, H]."""
    for layer in base.layers:
        hidden = decoder_layer(layer, hidden, rotary, kv)
    return apply_norm(base.norm, hidden)
