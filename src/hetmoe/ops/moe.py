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
    """Packed expert weights for the cpu backend: bf16, int8, int4 or fp8 (FP8 checkpoints'
    e4m3 weights and block scales as stored). None: fp8 for an FP8 checkpoint whose scale blocks
    are whole 32-column groups, else bf16."""

    def __post_init__(self) -> None:
        if self.weight_format not in (None, "bf16", "int8", "int4", "fp8"):
            raise ValueError(
                f"weight_format must be bf16, int8, int4 or fp8, got {self.weight_format!r}"
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


def moe_layers(model: nn.Module) -> list[HybridMoE]:
    """The model's hybrid MoE modules in execution order."""
    return [m for m in model.modules() if isinstance(m, HybridMoE)]


def _backend_name(options: HybridMoEOptions, ctx: OpContext) -> str:
    name = ctx.experts or options.experts
    if name == "auto":
        cpu = backends().get("cpu")
        return "cpu" if cpu is not None and cpu.unavailable() is None else "torch"
    return name


def _weight_format(options: HybridMoEOptions, ctx: OpContext,
                   backend: str) -> tuple[str | None, int | None]:
    """The cpu experts' format and, for fp8, a group that divides the checkpoint's scale blocks
    (None: the format's default). FP8 checkpoints keep their experts in FP8 unless the rules
    ask for another format (or the blocks are narrower than a 32-column group)."""
    fmt = options.weight_format
    if ctx.fp8 is None or (fmt is None and backend != "cpu"):
        return fmt, None
    return ctx.fp8.cpu_expert_format(fmt)


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
    name = _backend_name(options, ctx)
    backend = get_backend(name)
    weight_format, group = _weight_format(options, ctx, name)
    extra = {"group_size": group} if group is not None else {}
    experts = backend(spec, device, ctx.dtype, weight_format, **extra)
    return HybridMoE(
        router,
        experts,
        device,
        shared_experts=getattr(module, "shared_experts", None),
        shared_expert=getattr(module, "shared_expert", None),
        shared_expert_gate=getattr(module, "shared_expert_gate", None),
    )
