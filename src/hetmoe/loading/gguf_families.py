"""MoE GGUF architectures as their HF families: the config from the GGUF metadata, and the tensors
under the names of the family's HF checkpoints, undoing what llama.cpp's converter changed.

    qwen3moe -> qwen3_moe    qwen2moe -> qwen2_moe    llama with expert_count -> mixtral
    deepseek2 -> deepseek_v3 (sigmoid router, `exp_probs_b`), else deepseek_v2

Fused experts `ffn_{gate,up,down}_exps` [E, out, in] are split into one tensor per expert (as are
old per-expert `ffn_gate.E` tensors); llama's q/k rows get HF's rotary order back; DeepSeek's MLA
`attn_k_b`/`attn_v_b` (split for llama.cpp's absorbed attention) are joined into `kv_b_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig

from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.gguf import GGUFFile, unpermute_rotary_rows

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")  # old llama.cpp files
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FUSED = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_DENSE = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GQA = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLA = {"attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
        "attn_output": "self_attn.o_proj"}
_MIXTRAL_W = {"gate": "w1", "down": "w2", "up": "w3"}


def _shared(module: str) -> dict[str, str]:
    return {f"ffn_{p}_shexp": f"mlp.{module}.{p}_proj" for p in ("gate", "up", "down")}


@dataclass(frozen=True)
class _Arch:
    """How one GGUF architecture's tensors are named in its HF family's checkpoints."""

    parts: dict[str, str]
    """GGUF tensor (after `blk.N.`) -> HF module path (after `model.layers.N.`)."""
    expert: Callable[[int, str], str]
    """(expert, gate/up/down) -> HF module path of one routed expert's projection."""
    permute_qk: bool = False
    """llama.cpp reorders llama's q/k rows for its rotary kernel; HF keeps the halves apart."""


def _qwen_expert(e: int, proj: str) -> str:
    return f"mlp.experts.{e}.{proj}_proj"


_ARCHS = {
    "qwen3moe": _Arch({**_NORMS, **_GQA, **_QK_NORM, "ffn_gate_inp": "mlp.gate"}, _qwen_expert),
    "qwen2moe": _Arch({**_NORMS, **_GQA, "ffn_gate_inp": "mlp.gate", **_shared("shared_expert"),
                       "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}, _qwen_expert),
    # V3's router bias is `exp_probs_b.bias` in GGUF, `mlp.gate.e_score_correction_bias` in HF.
    "deepseek2": _Arch({**_NORMS, **_MLA, **_DENSE, "ffn_gate_inp": "mlp.gate",
                        "exp_probs_b": "mlp.gate.e_score_correction", **_shared("shared_experts")},
                       _qwen_expert),
    "llama": _Arch({**_NORMS, **_GQA, "ffn_gate_inp": "block_sparse_moe.gate"},
                   lambda e, p: f"block_sparse_moe.experts.{e}.{_MIXTRAL_W[p]}", permute_qk=True),
}


def gguf_config(g: GGUFFile) -> Any:
    """The HF config of the GGUF's family (a transformers `PretrainedConfig`)."""
    model_type, fields = _config_fields(g)
    return AutoConfig.for_model(model_type, **fields)


def _config_fields(g: GGUFFile) -> tuple[str, dict[str, Any]]:
    arch, names = g.arch, {t.name for t in g.reader.tensors}
    if arch == "llama" and "llama.expert_count" not in g.metadata:
        raise CheckpointError(f"{g.path}: a llama GGUF without field 'llama.expert_count' is a "
                              "dense model; hetmoe runs MoE models (llama with experts: Mixtral)")
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{g.path}: tensor 'token_embd.weight' is missing")
    heads = int(g.arch_field("attention.head_count"))
    common: dict[str, Any] = {
        "vocab_size": int(_tensor(g, "token_embd.weight").shape[-1]),  # GGUF shape [H, V]
        "hidden_size": int(g.arch_field("embedding_length")),
        "num_hidden_layers": int(g.arch_field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.arch_field("attention.head_count_kv", heads)),
        "max_position_embeddings": int(g.arch_field("context_length")),
        "rms_norm_eps": float(g.arch_field("attention.layer_norm_rms_epsilon")),
        "intermediate_size": int(g.arch_field("feed_forward_length")),
        "num_experts_per_tok": int(g.arch_field("expert_used_count")),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": float(g.arch_field("rope.freq_base", 10000.0))},
        **{f"{t}_token_id": int(g.metadata[f"tokenizer.ggml.{t}_token_id"])
           for t in ("bos", "eos", "pad") if f"tokenizer.ggml.{t}_token_id" in g.metadata},
    }
    if arch == "llama":
        head_dim = int(g.arch_field("rope.dimension_count", common["hidden_size"] // heads))
        return "mixtral", {**common, "head_dim": head_dim, "sliding_window": None,
                           "num_local_experts": int(g.arch_field("expert_count"))}
    moe = {"moe_intermediate_size": int(g.arch_field("expert_feed_forward_length"))}
    if arch in ("qwen3moe", "qwen2moe"):
        qwen = {**common, **moe, "num_experts": int(g.arch_field("expert_count")),
                "decoder_sparse_step": 1, "mlp_only_layers": []}
        if arch == "qwen2moe":  # llama.cpp's qwen2moe never normalizes the top-k weights
            shared = int(g.arch_field("expert_shared_feed_forward_length"))
            return "qwen2_moe", {**qwen, "shared_expert_intermediate_size": shared,
                                 "norm_topk_prob": False}
        head_dim = int(g.arch_field("attention.key_length", common["hidden_size"] // heads))
        return "qwen3_moe", {**qwen, "head_dim": head_dim, "norm_topk_prob": True}
    return _deepseek_fields(g, {**common, **moe}, names)


def _deepseek_fields(g: GGUFFile, common: dict[str, Any],
                     names: set[str]) -> tuple[str, dict[str, Any]]:
    # Sigmoid scoring with a bias-corrected top-k is V3's router; V2 scores by softmax.
    v3 = int(g.arch_field("expert_gating_func", 1)) == 2 or any("exp_probs_b" in n for n in names)
    rope = int(g.arch_field("rope.dimension_count"))
    groups = int(g.arch_field("expert_group_count", 1))
    q_lora = g.arch_field("attention.q_lora_rank", None)
    fields = {
        **common,
        "num_key_value_heads": common["num_attention_heads"],  # llama.cpp writes MLA as MQA
        "kv_lora_rank": int(g.arch_field("attention.kv_lora_rank")),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_rope_head_dim": rope,
        # Files written for absorbed MLA keep the per-head sizes in *_mla fields.
        "qk_nope_head_dim": int(g.arch_field("attention.key_length_mla",
                                             g.arch_field("attention.key_length"))) - rope,
        "v_head_dim": int(g.arch_field("attention.value_length_mla",
                                       g.arch_field("attention.value_length"))),
        "n_routed_experts": int(g.arch_field("expert_count")),
        "n_shared_experts": int(g.arch_field("expert_shared_count", 0)),
        "first_k_dense_replace": int(g.arch_field("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(g.arch_field("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(g.arch_field("expert_weights_norm", False)),
        "n_group": groups,
        "topk_group": int(g.arch_field("expert_group_used_count", 1)),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
    }
    if g.arch_field("rope.scaling.type", "none") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim and assumes mscale equals it.
        mscale = round(float(g.arch_field("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        fields["rope_parameters"] = {
            **fields["rope_parameters"], "rope_type": "yarn",
            "factor": float(g.arch_field("rope.scaling.factor")),
            "original_max_position_embeddings":
                int(g.arch_field("rope.scaling.original_context_length")),
            "beta_fast": float(g.arch_field("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(g.arch_field("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale,
        }
    return ("deepseek_v3" if v3 else "deepseek_v2"), fields


def _tensor(g: GGUFFile, name: str) -> Any:
    return next(t for t in g.reader.tensors if t.name == name)


def gguf_tensors(g: GGUFFile, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, fp32 tensor) for every tensor of the file, in file order."""
    arch = _ARCHS[g.arch]
    kv_heads = config.num_key_value_heads
    heads = {"attn_q": config.num_attention_heads, "attn_k": kv_heads}
    mla: dict[str, dict[str, torch.Tensor]] = {}
    for info in g.reader.tensors:
        name = info.name
        per_expert, block = _PER_EXPERT.match(name), _BLOCK.match(name)
        if per_expert:
            layer, proj, e = per_expert.groups()
            yield f"model.layers.{layer}.{arch.expert(int(e), proj)}.weight", g.read(info)
        elif block is None:
            base, _, kind = name.rpartition(".")
            if base not in _GLOBAL:
                raise CheckpointError(f"{g.path}: tensor {name!r} has no HF name for {g.arch}")
            yield f"{_GLOBAL[base]}.{kind}", g.read(info)
        else:
            layer, part, kind = block.groups()
            prefix = f"model.layers.{layer}."
            if part in _FUSED:
                stacked = g.read(info)  # [E, out, in]
                for e in range(stacked.shape[0]):
                    hf = arch.expert(e, _FUSED[part])
                    yield f"{prefix}{hf}.weight", stacked[e].clone()
            elif part in ("attn_k_b", "attn_v_b") and g.arch == "deepseek2":
                pair = mla.setdefault(layer, {})
                pair[part] = g.read(info)
                if len(pair) == 2:
                    yield f"{prefix}self_attn.kv_b_proj.weight", _kv_b(pair["attn_k_b"],
                                                                       pair["attn_v_b"])
            elif part in arch.parts:
                value = g.read(info)
                if arch.permute_qk and part in heads:
                    value = unpermute_rotary_rows(value.reshape(value.shape[0], -1),
                                                  heads[part]).reshape(value.shape)
                if part == "ffn_gate_inp_shexp" and value.dim() == 1:
                    # Linear(H, 1): llama.cpp's quantizer writes it without its unit dim.
                    value = value[None]
                suffix = "_bias" if part == "exp_probs_b" else f".{kind}"
                yield f"{prefix}{arch.parts[part]}{suffix}", value
            else:
                raise CheckpointError(f"{g.path}: tensor {name!r} has no HF name for {g.arch}")


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), rank] from llama.cpp's k_b [heads, rank, nope] (transposed
    for absorption) and v_b [heads, v, rank]."""
    rank = k_b.shape[1]
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, rank).contiguous()
