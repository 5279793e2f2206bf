"""`RoutedExperts`: the cpu backend's call with gradients for x and the routing weights, in fp32
(exact forward) and bf16 (the inference kernels' forward), against float64 autograd."""

from __future__ import annotations

import torch
from grad_oracle import dequantized, make_call, reference_grads, rel_error

from hetmoe.experts.backend import ExpertSpec
from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.expert_function import needs_grad, routed_experts

E, H, I = 6, 96, 64


def _experts() -> CpuExperts:
    g = torch.Generator().manual_seed(5)
    experts = CpuExperts(ExpertSpec(E, H, I, "silu"), torch.device("cpu"), torch.float32,
                         "int8", group_size=32)
    experts.moe.load(torch.randn(E, I, H, generator=g) / H**0.5,
                     torch.randn(E, I, H, generator=g) / H**0.5,
                     torch.randn(E, H, I, generator=g) / I**0.5)
    return experts


def test_fp32_and_bf16_gradients() -> None:
    experts = _experts()
    x, ids, weights, dy = make_call(E, H, 13, 3, seed=2)
    ref_dx, ref_dw = reference_grads(dequantized(experts.moe), x, ids, weights, dy)
    for dtype, bound in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        xg = x.to(dtype).clone().requires_grad_()
        wg = weights.clone().requires_grad_()
        assert needs_grad(experts, xg, wg)
        done = None if dtype == torch.float32 else experts.moe.forward(xg.detach(), ids, weights)
        out = routed_experts(experts, xg, ids, wg, done)
        assert out.dtype == dtype and out.requires_grad
        out.float().backward(dy)
        assert xg.grad is not None and wg.grad is not None
        assert rel_error(xg.grad, ref_dx) < bound, dtype
        assert rel_error(wg.grad, ref_dw) < bound, dtype
    with torch.no_grad():
        assert not needs_grad(experts, x.clone().requires_grad_(), weights)
