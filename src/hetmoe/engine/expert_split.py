"""Where each routed expert of a GPU prefill layer runs: on the CPU, or streamed to the GPU.

Per MoE layer, once the router has run, n_e of the prompt's (token, slot) pairs go to expert e
(an expert with none runs nowhere and is not copied). Costs, measured on this machine
(`measure_cpu_costs`, `LayerStreamer.measure_copy`):

    CPU: cpu_fixed + cpu_token * n_e   (its packed weights read once, then its tokens' products)
    GPU: gpu_expert + gpu_token * n_e  (its packed bytes over PCIe, then its products)

The lightest experts go to the CPU and the rest to the GPU, at the split that lets the two sides
finish closest together (min over k of max(CPU(k lightest), GPU(the rest)); SMoE's Algorithm 1
in spirit). Such a split copies a layer only once its router has run, so a pass splits only when
that beats streaming every expert of every layer ahead of its use (`prefer_split`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hetmoe.experts.cpu_moe import CpuMoE

SPLIT_GAIN = 0.8
"""A pass splits when its expected layer time is below this share of streaming every expert:
the rest pays for what splitting cannot overlap (the router's result read on the host before
the copies start, attention and the GPU's products beside the copies)."""


@dataclass(frozen=True)
class SplitCosts:
    """Seconds per routed expert of one layer on each side (see the module docstring)."""

    cpu_fixed: float
    """CPU: one expert with tokens (its weights read from memory)."""
    cpu_token: float
    """CPU: each (token, expert) pair beyond that."""
    gpu_expert: float
    """GPU: one expert copied over PCIe (its packed bytes)."""
    gpu_token: float = 0.0
    """GPU: each (token, expert) pair (small beside the copy; 0 ignores it)."""


def plan_split(counts: torch.Tensor, costs: SplitCosts) -> torch.Tensor:
    """counts [E] (pairs routed to each expert) -> on_gpu bool [E]: the experts to stream and run
    on the GPU; the other experts with pairs run on the CPU."""
    counts = counts.to("cpu", torch.float64)
    active = (counts > 0).nonzero().squeeze(1)  # [A]
    order = active[torch.argsort(counts[active], stable=True)]  # lightest first
    n = counts[order]
    zero = torch.zeros(1, dtype=torch.float64)
    # [A + 1] each, at k = 0..A: the CPU runs the k lightest, the GPU the rest.
    cpu = torch.cat([zero, (costs.cpu_fixed + costs.cpu_token * n).cumsum(0)])
    gpu_each = costs.gpu_expert + costs.gpu_token * n
    gpu = torch.cat([gpu_each.flip(0).cumsum(0).flip(0), zero])
    k = int(torch.maximum(cpu, gpu).argmin())
    on_gpu = torch.zeros(counts.shape[0], dtype=torch.bool)
    on_gpu[order[k:]] = True
    return on_gpu


def split_seconds(counts: torch.Tensor, costs: SplitCosts) -> float:
    """Expected seconds of a layer split by `plan_split` (the later side)."""
    counts = counts.to("cpu", torch.float64)
    on_gpu = plan_split(counts, costs)
    on_cpu = (counts > 0) & ~on_gpu
    cpu = float((costs.cpu_fixed + costs.cpu_token * counts[on_cpu]).sum())
    gpu = float((costs.gpu_expert + costs.gpu_token * counts[on_gpu]).sum())
    return max(cpu, gpu)


def prefer_split(tokens: int, top_k: int, num_experts: int, costs: SplitCosts) -> bool:
    """Whether a pass of `tokens` should split each layer between CPU and GPU rather than stream
    every expert ahead; judged at an even spread of the pairs over the experts (a router that
    concentrates them favours splitting further)."""
    even = torch.full((num_experts,), tokens * top_k / num_experts, dtype=torch.float64)
    stream = num_experts * (costs.gpu_expert + costs.gpu_token * float(even[0]))
    return split_seconds(even, costs) < SPLIT_GAIN * stream


def measure_cpu_costs(moe: CpuMoE, experts: int = 16, small: int = 8,
                      large: int = 128, repeats: int = 3) -> tuple[float, float]:
    """(cpu_fixed, cpu_token) of `moe`'s experts on this machine: `experts` experts with `small`
    then `large` tokens each (each repeat on other experts, so their weights come from memory as
    in a prefill), best of `repeats`; a line through the two."""
    experts = min(experts, moe.num_experts)
    per_expert = {}
    for n in (small, large):
        x = torch.randn(experts * n, moe.hidden, generator=torch.Generator().manual_seed(n))
        x = x.to(torch.bfloat16)
        weights = torch.ones(experts * n, 1)
        best = float("inf")
        for r in range(repeats):
            first = (r * experts) % max(1, moe.num_experts - experts + 1)
            ids = torch.arange(first, first + experts).repeat_interleave(n)[:, None]  # [T, 1]
            start = time.perf_counter()
            moe.forward(x, ids, weights)
            best = min(best, time.perf_counter() - start)
        per_expert[n] = best / experts
    token = max(0.0, (per_expert[large] - per_expert[small]) / (large - small))
    return max(0.0, per_expert[small] - small * token), token
