"""`hybrid_moe`: router and shared experts on the op's device, routed experts in a backend.

Built from the HF sparse-MoE block it replaces, keeping its child names so checkpoint tensors land
directly: `gate` (router weight, DeepSeek-V3's `e_score_correction_bias`), `experts` (the expert
backend: per-expert tensors arrive through its `load_tensor`), `shared_experts` (DeepSeek) or
`shared_expert` + `shared_expert_gate` (Qwen2-MoE), which stay the HF modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.experts.backend import ExpertBackend, ExpertSpec, backends, get_backend
from hetmoe.inject.registry import OpContext, register_op
from hetmoe.ops.moe_step import MoEStep, backend_link
from hetmoe.ops.router import Router, RouterConfig


@dataclass(frozen=True)
class HybridMoEOptions:
    """Rule kwargs of `hybrid_moe`."""

    experts: str = "auto"
    """Routed-expert backend: a registered name (`torch`, `cpu`) or `auto` (cpu when built)."""
    weight_format: str | None = None
    """Packed expert weights for the cpu backend: bf16, int8 or int4 (None: bf16)."""

    def __post_init__(self) -> None:
        if self.weight_format not in (None, "bf16", "int8", "int4"):
            raise ValueError(
                f"weight_format must be bf16, int8 or int4, got {self.weight_format!r}"
            )
        known = backends()
        if self.experts != "auto" and self.experts not in known:
            raise ValueError(
                f"experts={self.experts!r} is not a registered expert backend "
                f"(known: auto, {', '.join(sorted(known))})"
            )


class HybridMoE(nn.Module):
    """`forward(hidden_states [..., H]) -> [..., H]`: routed (backend) + shared experts."""

    def __init__(
        self,
        gate: Router,
        experts: ExpertBackend,
        device: torch.device,
        shared_experts: nn.Module | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.device = device
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.step: MoEStep | None = None
        """The engine's MoE step when one is attached (ops/moe_step.py); else a plain one."""
        self._plain: MoEStep | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routes, starts the routed experts, runs shared experts meanwhile, then combines
        (`MoEStep.forward`, the one MoE story)."""
        step = self.step
        if step is None:
            if self._plain is None:
                link = backend_link(self)
                self._plain = MoEStep([self], lambda i: link)
            step = self._plain
        return step.forward(self, hidden_states)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output on x [T, H] (None: the layer has none)."""
        if self.shared_experts is not None:
            return self.shared_experts(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = F.sigmoid(self.shared_expert_gate(x))  # [T, 1]
            return gate * self.shared_expert(x)
        return None


def _backend_name(options: HybridMoEOptions, ctx: OpContext) -> str:
    name = ctx.experts or options.experts
    if name == "auto":
        cpu = backends().get("cpu")
        return "cpu" if cpu is not None and cpu.unavailable() is None else "torch"
    return name


@register_op("hybrid_moe", HybridMoEOptions)
def build_hybrid_moe(
    module: nn.Module, device: torch.device, options: HybridMoEOptions, ctx: OpContext
) -> HybridMoE:
    """Replaces a HF sparse-MoE block (any supported family)."""
    hf_experts = getattr(module, "experts", None)
    if getattr(module, "gate", None) is None or hf_experts is None:
        raise ValueError("hybrid_moe replaces sparse-MoE blocks (children `gate` and `experts`)")
    config = ctx.config
    spec = ExpertSpec(
        num_experts=hf_experts.num_experts,
        hidden_size=hf_experts.hidden_dim,
        intermediate_size=hf_experts.intermediate_dim,
        activation=config.hidden_act,
    )
    router = Router(RouterConfig.from_hf(config), spec.hidden_size, ctx.dtype)
    backend = get_backend(_backend_name(options, ctx))
    experts = backend(spec, device, ctx.dtype, options.weight_format)
    return HybridMoE(
        router,
        experts,
        device,
        shared_experts=getattr(module, "shared_experts", None),
        shared_expert=getattr(module, "shared_expert", None),
        shared_expert_gate=getattr(module, "shared_expert_gate", None),
    )
