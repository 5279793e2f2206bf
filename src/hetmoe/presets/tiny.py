"""Tiny random checkpoints of every supported family: the baby models of tests and `tiny-*` presets.

`build_tiny_model(family, path)` writes a directory that looks like a real checkpoint of that family
(config.json, per-expert safetensors keys as transformers saves them, a tokenizer with a chat
template), with deterministic random weights scaled so that routing and greedy decoding are decisive
rather than near-ties. Options reproduce the awkward parts of real checkpoints: bf16 weights,
FP8 e4m3 block-scaled weights with `weight_scale_inv` (DeepSeek-V3), sharding with an index, and the
extra multi-token-prediction layer DeepSeek-V3 ships after its last decoder layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hetmoe.presets import Preset, register_preset
from hetmoe.presets.tokenizer import save_tiny_tokenizer

FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "mixtral")
"""Supported `model_type`s, in the order presets are listed."""

FP8_BLOCK = 16
"""Block edge of the tiny FP8 checkpoints (real DeepSeek-V3 uses 128; 16 leaves partial blocks)."""

_FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Shared by every family; bos/eos/pad ids match the tiny tokenizer's special tokens.
_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    tie_word_embeddings=False,
)

_MLA: dict[str, Any] = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
)

# Per family: default layer count and the config fields that make the baby exercise its semantics.
_FAMILY_CONFIG: dict[str, tuple[int, dict[str, Any]]] = {
    "qwen3_moe": (2, dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=4, norm_topk_prob=True,
    )),
    "qwen2_moe": (2, dict(
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=False,
    )),
    "deepseek_v2": (3, dict(
        _MLA, q_lora_rank=None, n_shared_experts=2, scoring_func="softmax",
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, norm_topk_prob=False,
    )),
    "deepseek_v3": (3, dict(
        _MLA, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc",
        rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        ),
    )),
    "mixtral": (2, dict(
        num_key_value_heads=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    )),
}


def tiny_config(family: str, *, num_layers: int | None = None, **overrides: Any) -> Any:
    """The transformers config of the tiny `family` model (a `model_type`, `-` or `_` separated)."""
    family = family.replace("-", "_")
    if family not in _FAMILY_CONFIG:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {FAMILIES}")
    default_layers, fields = _FAMILY_CONFIG[family]
    kwargs = {**_COMMON, **fields, "num_hidden_layers": num_layers or default_layers, **overrides}
    return AutoConfig.for_model(family, **kwargs)


def build_tiny_model(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: bool = False,
    fp8_block: int = FP8_BLOCK,
    sharded: bool = False,
    mtp_layer: bool = False,
    **config_overrides: Any,
) -> Path:
    """Writes a tiny random checkpoint of `family` into `path` and returns `path`.

    `fp8` stores every projection weight as float8_e4m3fn with a per-block `weight_scale_inv`
    (blocks of `fp8_block`) and a `quantization_config` like real DeepSeek-V3; `sharded` splits the
    weights into at least two files with `model.safetensors.index.json`; `mtp_layer` adds tensors of
    a layer numbered `num_hidden_layers`, as DeepSeek-V3's multi-token-prediction layer.
    """
    path = Path(path)
    config = tiny_config(family, num_layers=num_layers, **config_overrides)
    # Built on meta and filled once by `_randomize`: transformers' own init would be wasted work.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gives each name its own tensor
        model.tie_weights()
    _randomize(model, config.hidden_size, seed)
    _keep_router_bias_fp32(model, dtype)
    # Three shards' worth per file, so even small configs give at least two files.
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(path, max_shard_size=total // 3 if sharded else total * 2)
    save_tiny_tokenizer(path)

    if fp8:
        _edit_config(path, quantization_config=dict(
            quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
            weight_block_size=[fp8_block, fp8_block],
        ))
    if fp8 or mtp_layer:
        extra = _mtp_tensors(config, seed) if mtp_layer else {}
        _rewrite_safetensors(path, extra=extra, fp8_block=fp8_block if fp8 else 0)
    return path


def _randomize(model: torch.nn.Module, hidden: int, seed: int) -> None:
    """Deterministic weights scaled so activations stay O(1) and logits and routing are peaked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1 and "norm" in name:
                value = 1.0 + 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name:
                value = noise
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                value = noise * (2.0 / math.sqrt(hidden))
            elif name == "lm_head.weight":
                value = noise * (3.0 / math.sqrt(hidden))
            else:  # [out, in] or fused experts [E, out, in]
                value = noise / math.sqrt(param.shape[-1])
            param.copy_(value)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, buf in model.state_dict().items():  # persistent buffers: saved, so must be set
            if name in params:
                continue
            if not name.endswith("e_score_correction_bias"):
                raise RuntimeError(f"tiny model buffer {name!r} has no random initialisation")
            buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))  # non-zero: ignoring it shows


def _keep_router_bias_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts to `dtype`, except DeepSeek-V3's correction bias (fp32 in real checkpoints)."""
    biases = {n: b.detach().clone() for n, b in model.named_buffers() if "e_score" in n}
    model.to(dtype)
    for name, value in biases.items():
        owner, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, value)


def _quantize_fp8(tensors: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Projection weights → float8_e4m3fn + `weight_scale_inv` [ceil(O/B), ceil(I/B)] per block."""
    out: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        if not (name.endswith("_proj.weight") and weight.dim() == 2):
            out[name] = weight
            continue
        rows, cols = weight.shape  # [O, I]
        grid = (math.ceil(rows / block), math.ceil(cols / block))
        padded = torch.zeros(grid[0] * block, grid[1] * block)
        padded[:rows, :cols] = weight.float()
        blocks = padded.view(grid[0], block, grid[1], block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX  # [O/B, I/B]
        quant = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
        out[name] = quant.to(torch.float8_e4m3fn).contiguous()
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
    return out


def _mtp_tensors(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """A few tensors of the layer after the last one, named as DeepSeek-V3's MTP layer."""
    gen = torch.Generator().manual_seed(seed + 1)
    hidden, layer = config.hidden_size, config.num_hidden_layers
    return {
        f"model.layers.{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{layer}.shared_head.norm.weight": torch.ones(hidden),
    }


def _rewrite_safetensors(path: Path, *, extra: dict[str, torch.Tensor], fp8_block: int) -> None:
    """Adds `extra` to the last file and FP8-quantizes every file in blocks of `fp8_block` (0:
    not), keeping the index."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    weight_map: dict[str, str] = {}
    total = 0
    for file in files:
        tensors = load_file(path / file)
        if file == files[-1]:
            tensors.update(extra)
        if fp8_block:
            tensors = _quantize_fp8(tensors, fp8_block)
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if index is not None:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.setdefault("metadata", {})["total_size"] = total
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def _edit_config(path: Path, **fields: Any) -> None:
    _edit_json(path / "config.json", **fields)


def _edit_json(path: Path, **fields: Any) -> None:
    """Sets `fields` in the JSON object file `path` (created when missing)."""
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(fields)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _builder(family: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        build_tiny_model(family, path)
        # Random weights: sampled text is as meaningless as greedy text, so the server answers
        # greedily by default, as the CLI does (the same text for the same prompt).
        _edit_json(path / "generation_config.json", do_sample=False)

    return build


def _register() -> None:
    for family in FAMILIES:
        name = "tiny-" + family.replace("_", "-")
        register_preset(Preset(
            name=name,
            description=f"random baby {family} model (vocab 512, hidden 64, 8 experts)",
            build=_builder(family),
            version=2,  # 2: greedy generation_config.json
        ))


_register()
