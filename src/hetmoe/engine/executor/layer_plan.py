"""`LayerPlan`: one decoder layer's weights and caches as the tensors a fused layer function
takes, and `plan_layers`, which says whether a model fits the fused decode step (GQA or MLA
attention with q_proj, RMSNorms, gated SiLU MLPs or `HybridMoE`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetmoe.ops.attention import StaticKVAttention
from hetmoe.ops.fused import absorbed_weights
from hetmoe.ops.mla import MLAttention
from hetmoe.ops.moe import HybridMoE
from hetmoe.ops.norm import eps_of, norm_weight
from hetmoe.ops.router import RouterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerStatics:
    """What a layer's compiled graph bakes in (equal for every layer of a model's kind)."""

    attention: str
    """`gqa` or `mla`."""
    eps: tuple[float, float, float]
    """Input norm, post-attention norm and q/k (or latent) norm epsilons."""
    heads: int
    """Query heads."""
    dims: tuple[int, ...]
    """gqa: (kv heads, head dim); mla: (nope, rope, v, kv_lora_rank)."""
    scale: float
    """Softmax scale."""
    rope: str
    """Rope form: `half`, `interleave` or `pairs` (ops/fused.py `rotate`)."""
    router: RouterConfig | None
    """The MoE router's semantics (None: a dense MLP layer)."""


def _norm(module: nn.Module | None) -> torch.Tensor:
    """An RMSNorm's weight, detached (ops/norm.py checks it is one)."""
    return norm_weight(module).detach()


def _plain(module: object) -> torch.Tensor:
    """The weight of a bias-free linear; ValueError otherwise."""
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise ValueError(f"fused decode needs bias-free linears, found {module!r}")
    return module.weight.detach()


class LayerPlan:
    """One decoder layer's weights and caches as the tensors the layer function takes."""

    def __init__(self, layer: Any, act: str) -> None:
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
            if getattr(layer, name, None) is None:
                raise ValueError(f"fused decode needs a decoder layer with `{name}`")
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norms = (_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm))
        self.moe: HybridMoE | None = mlp if isinstance(mlp, HybridMoE) else None
        self.window: int | None = None
        if isinstance(attn, StaticKVAttention):
            self.window = attn.sliding_window
            qkv, bias = attn.fused_qkv()
            q_norm = k_norm = None
            qk_eps = 0.0
            if attn.q_norm is not None and attn.k_norm is not None:
                q_norm, k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
                qk_eps = eps_of(attn.q_norm)
            self.weights: tuple[torch.Tensor | None, ...] = (
                qkv, bias, q_norm, k_norm, _plain(attn.o_proj))
            dims: tuple[int, ...] = (attn.num_kv_heads, attn.head_dim)
            heads = (qkv.shape[0] - 2 * attn.num_kv_heads * attn.head_dim) // attn.head_dim
            kind, rope = "gqa", "half"
        elif isinstance(attn, MLAttention):
            kv_b = attn._plain_kv_b_weight()
            if kv_b is None or attn.q_proj is None:
                raise ValueError("fused decode needs MLA with q_proj and a plain kv_b_proj")
            w_k, w_v = absorbed_weights(kv_b.detach(), attn.num_heads, attn.nope_dim, attn.v_dim)
            self.weights = (_plain(attn.q_proj), _plain(attn.kv_a_proj_with_mqa),
                            _norm(attn.kv_a_layernorm), w_k, w_v, _plain(attn.o_proj))
            qk_eps = eps_of(attn.kv_a_layernorm)
            dims = (attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank)
            heads, kind = attn.num_heads, "mla"
            rope = "interleave" if attn.interleave else "pairs"
        else:
            raise ValueError(f"fused decode has no form for {type(attn).__name__}")
        if act != "silu":
            raise ValueError(f"fused decode needs SiLU MLPs, found hidden_act={act!r}")
        self.dense: tuple[torch.Tensor, ...] | None = None
        self.shared: tuple[torch.Tensor, ...] | None = None
        self.shared_gate: torch.Tensor | None = None
        router = None
        if self.moe is not None:
            router = self.moe.gate.config
            self.router = (self.moe.gate.weight.detach(),
                           self.moe.gate.e_score_correction_bias if router.has_bias else None)
            shared = self.moe.shared_experts or self.moe.shared_expert
            if shared is not None:
                self.shared = _mlp(shared)
            if self.moe.shared_expert_gate is not None:
                self.shared_gate = _plain(self.moe.shared_expert_gate)
        else:
            self.dense = _mlp(mlp)
        self.statics = LayerStatics(
            kind, (eps_of(layer.input_layernorm), eps_of(layer.post_attention_layernorm), qk_eps),
            heads, dims, float(attn.scaling), rope, router)

    def caches(self) -> tuple[torch.Tensor, ...]:
        """The layer's cache tensors (allocated by the runner's cache after this plan)."""
        if isinstance(self.attn, StaticKVAttention):
            assert self.attn.kv_cache is not None
            return (self.attn.kv_cache,)
        assert self.attn.latent_cache is not None and self.attn.rope_cache is not None
        return (self.attn.latent_cache, self.attn.rope_cache)


def _mlp(module: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(_plain(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))


def plan_layers(model: Any) -> list[LayerPlan]:
    """Every decoder layer's plan; ValueError naming the first layer the fused path cannot run."""
    base = getattr(model, model.base_model_prefix)
    act = str(getattr(model.config, "hidden_act", "silu"))
    plans = []
    for i, layer in enumerate(base.layers):
        try:
            plans.append(LayerPlan(layer, act))
        except ValueError as exc:
            raise ValueError(f"decoder layer {i}: {exc}") from exc
    return plans


def fits_fused(model: Any) -> bool:
    """Whether every decoder layer fits the fused decode step (the reason is logged if not)."""
    try:
        plan_layers(model)
    except ValueError as exc:
        log.info("fused decode does not fit this model (%s): module path", exc)
        return False
    return True
