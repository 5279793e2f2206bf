"""The CPU experts as an autograd op: routed-expert output with gradients for x and the routing
weights (experts frozen), so the router, everything before it and LoRA adapters learn.

`BackendLink` (ops/moe_step.py) calls `routed_experts` when grad is enabled and the layer's experts
are the `cpu` backend: the backend's own gradient (as autograd is the `torch` backend's), so it
lives here and inference never imports training (train/). Precision follows the activations:
fp32 x gets the expert math in fp32 (`expert_forward_fp32`, computed at `finish`), bf16 x the
inference kernels' forward (submitted at `start`, so it overlaps the shared experts); the backward
likewise (expert_grad.py: fp32 GEMMs, or the inference kernels in bf16 with AMX tiles).
Backward recomputes the experts' activations from the saved x, ids and weights
(csrc/moe/backward_job.h): nothing per expert is kept between the passes (the recompute was a
fifth of the bf16 backward's CPU time at the Qwen3-30B-A3B shape, docs/benchmarks/sft.md;
keeping gate/up would hold 2 x T x K x I values per layer).
The backward node's inputs are CPU tensors, so autograd runs it on the CPU thread while the GPU
thread goes on with the graph's other branches (shared experts, attention).
"""

from __future__ import annotations

from typing import Any

import torch

from hetmoe.experts.backend import ExpertBackend
from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.expert_grad import expert_backward, expert_forward_fp32


class RoutedExperts(torch.autograd.Function):
    """out [T, H] = sum_j w_j expert_{ids_j}(x) on a `CpuExperts` backend; grads for x, w."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: CpuExperts, out: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, ids, weights)
        ctx.experts = experts
        if out is None:
            out = expert_forward_fp32(experts.moe, x, ids, weights).to(x.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, ids, weights = ctx.saved_tensors
        dx, dweights = expert_backward(ctx.experts.moe, x, ids, weights, grads[0])
        return dx.to(x.dtype), dweights.to(weights.dtype), None, None, None


def needs_grad(experts: ExpertBackend, x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether a call must go through `RoutedExperts`: grad enabled, an input that wants it and
    the `cpu` backend (the `torch` backend is differentiable as it is)."""
    return (torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)
            and isinstance(experts, CpuExperts))


def fp32_experts(x: torch.Tensor) -> bool:
    """Whether a training call computes the experts in fp32 (fp32 activations)."""
    return x.dtype == torch.float32


def routed_experts(experts: CpuExperts, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The routed output on the CPU with gradients: `out` is the backend's forward of (x, ids,
    weights) when already computed (bf16), None to compute it in fp32 here."""
    cpu = torch.device("cpu")
    x_cpu = x.to(cpu)
    ids_cpu = ids.to(cpu, torch.int64).contiguous()
    w_cpu = weights.to(cpu, torch.float32)
    result: torch.Tensor = RoutedExperts.apply(x_cpu, w_cpu, ids_cpu, experts, out)
    return result
