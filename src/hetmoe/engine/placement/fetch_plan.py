"""Fetch-or-compute: which of a step's CPU misses are copied to the GPU and computed there.

In a step with resident experts (engine/placement/slots.py) the CPU computes every miss. When a few
misses carry many tokens (a prefill chunk, batched decode on skewed routing) the CPU is the
long pole: such an expert costs the CPU its weights' read plus every token's products, while
the GPU would pay its bytes over PCIe once and little per token. Per layer and step, with n_e
the tokens of missed expert e (`SplitCosts` from this machine's profile,
engine/placement/expert_split.py):

    cpu(n)   = cpu_fixed + n * cpu_token                    (one miss on the CPU)
    fetch(n) = gpu_expert + gpu_fixed + n * gpu_token       (its copy, then its GPU compute)
    CPU      = cpu_call + sum of cpu(n_e) over the misses kept
    GPU      = sum of fetch(n_e) over the misses fetched    (all copies, then one compute)

An expert is a candidate only when fetch(n) < cpu(n); candidates are taken heaviest first,
each one only if max(CPU, GPU) shrinks, at most `slots` of them (the staging pool). With one
token per expert (decode at batch 1, and batched decode on spread routing) fetch(1) > cpu(1)
on any machine whose PCIe is slower than its CPU's memory reads (the copy alone moves the
same bytes the CPU reads), so nothing is fetched there; `least_tokens` says from how many tokens
per expert a fetch can pay, so a step with fewer tokens skips the plan (and its host sync).
"""

from __future__ import annotations

import math

import torch

from hetmoe.engine.placement.expert_split import SplitCosts


def cpu_seconds(tokens: int, costs: SplitCosts) -> float:
    """Seconds of one missed expert with `tokens` tokens on the CPU."""
    return costs.cpu_fixed + tokens * costs.cpu_token


def fetch_seconds(tokens: int, costs: SplitCosts) -> float:
    """Seconds of one missed expert with `tokens` tokens copied to the GPU and computed there."""
    return costs.gpu_expert + costs.gpu_fixed + tokens * costs.gpu_token


def least_tokens(costs: SplitCosts) -> float:
    """The fewest tokens on one expert for which fetching it beats the CPU (inf: never)."""
    per_token = costs.cpu_token - costs.gpu_token
    extra = costs.gpu_expert + costs.gpu_fixed - costs.cpu_fixed
    if extra < 0:
        return 1.0
    if per_token <= 0:
        return math.inf
    return float(math.floor(extra / per_token) + 1)


def plan_fetch(tokens: torch.Tensor, costs: SplitCosts, slots: int) -> list[int]:
    """tokens [E]: tokens per expert among a layer's CPU misses (0: not routed or resident) ->
    the expert ids to fetch, heaviest first (see the module docstring); ties: lower id."""
    if tokens.dim() != 1:
        raise ValueError(f"plan_fetch: tokens per expert must be [E], found {tuple(tokens.shape)}")
    if slots < 0:
        raise ValueError(f"plan_fetch: slots must be >= 0, got {slots}")
    counts = [int(n) for n in tokens.tolist()]
    if any(n < 0 for n in counts):
        raise ValueError("plan_fetch: tokens per expert must be >= 0")
    cpu = costs.cpu_call + sum(cpu_seconds(n, costs) for n in counts if n)
    gpu = 0.0
    picked: list[int] = []
    routed = sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], e))
    for expert in routed:
        if len(picked) == slots:
            break
        on_cpu, fetched = cpu_seconds(counts[expert], costs), fetch_seconds(counts[expert], costs)
        if fetched >= on_cpu:
            continue
        if max(cpu - on_cpu, gpu + fetched) >= max(cpu, gpu):
            continue  # the GPU side would become the long pole (a lighter one may still fit)
        cpu, gpu = cpu - on_cpu, gpu + fetched
        picked.append(expert)
    return picked
