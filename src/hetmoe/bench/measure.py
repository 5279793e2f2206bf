"""Measurements behind `hetmoe bench`: read bandwidth, routed bytes, decode/prefill speed, launches.

Every timing synchronizes the device before reading the clock; decode speed is greedy generation
through the runner's one entry, `step` (a prefill chunk, then greedy decode rows), the token fed
back each step as a host int (what a server does), so one device-to-host sync per token is part
of the measured step.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import EXPLORE_PASSES
from hetmoe.engine.step import PrefillChunk, StepPlan
from hetmoe.ops.moe import moe_layers

# CUDA runtime calls counted per decoded token.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaLaunchHostFunc")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_token(runner: ModelRunner, slot: int, prompt: list[int]) -> int:
    """Prefills `prompt` into `slot` (one runner step); the argmax of its last logits."""
    out = runner.step(StepPlan(prefills=(PrefillChunk(slot, tuple(prompt)),)))
    return int(out.prefill_logits[0][-1].argmax())


def next_token(runner: ModelRunner, slot: int, token: int) -> int:
    """One decode step of `slot` with its logits read on the host; their argmax."""
    logits = runner.step(StepPlan((slot,), (token,))).logits
    assert logits is not None
    return int(logits[0].argmax())


def read_bandwidth(gib: float = 2.0, repeats: int = 8) -> float:
    """Host memory read bandwidth in GB/s: best of `repeats` sums over a `gib` GiB float32 array
    (all torch threads); measure it before the CPU backend's pool starts spinning."""
    n = int(gib * 2**30) // 4
    data = torch.empty(n, dtype=torch.float32).uniform_()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return n * 4 / best / 1e9


def routed_bytes_per_token(model: nn.Module) -> int:
    """Bytes of routed-expert weights one token reads (K experts per MoE layer, scales included)."""
    total = 0
    for moe in moe_layers(model):
        spec, k = moe.experts.spec, moe.gate.config.top_k
        try:
            per_expert = cpu_moe_of(moe.experts).packed_bytes / spec.num_experts
        except ValueError:  # plain-torch experts: three bf16 matrices
            per_expert = 3 * spec.hidden_size * spec.intermediate_size * 2
        total += int(per_expert * k)
    return total


@dataclass
class DecodeRun:
    """Greedy decode of one sequence: tokens and per-step wall times (first step excluded)."""

    tokens: list[int]
    step_s: list[float]
    prefill_s: float

    @property
    def tok_s(self) -> float:
        """Decode tokens per second over the timed steps (median step)."""
        return 1.0 / statistics.median(self.step_s)

    @property
    def mean_tok_s(self) -> float:
        """Decode tokens per second over all timed steps (total time)."""
        return len(self.step_s) / sum(self.step_s)


def greedy_decode(runner: ModelRunner, prompt: list[int], new_tokens: int) -> DecodeRun:
    """Prefills `prompt` into a fresh slot, then decodes `new_tokens` greedily through the
    runner's `greedy` steps (what a greedy request runs); frees the slot.

    A step's time is the interval between two tokens read; the first decode step (graph capture,
    warm-up) is not timed.
    """
    device = runner.device
    slot = runner.cache.allocate()
    try:
        sync(device)
        start = time.perf_counter()
        token = first_token(runner, slot, prompt)
        prefill_s = time.perf_counter() - start
        tokens, steps = [token], []
        try:
            start = time.perf_counter()
            for i in range(new_tokens - 1):  # each step launched before the last is read
                plan = StepPlan((slot,), (tokens[-1],), greedy=True, ahead=i + 2 < new_tokens)
                out = runner.step(plan).tokens
                assert out is not None
                tokens.append(out[0])
                now = time.perf_counter()
                if i:
                    steps.append(now - start)
                start = now
        finally:
            runner.settle()
        return DecodeRun(tokens, steps, prefill_s)
    finally:
        runner.cache.free(slot)


def prefill_speed(runner: ModelRunner, length: int, vocab: int, repeats: int = 2) -> float:
    """Prompt tokens per second of one prefill of `length` random tokens (best of `repeats`)."""
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length))
    best = float("inf")
    for _ in range(repeats):
        slot = runner.cache.allocate()
        try:
            sync(runner.device)
            start = time.perf_counter()
            first_token(runner, slot, ids.tolist())
            sync(runner.device)
            best = min(best, time.perf_counter() - start)
        finally:
            runner.free(slot)
    return length / best


def settle_prefill(runner: ModelRunner, length: int, vocab: int) -> int:
    """Runs untimed prefills of `length` tokens until the prefill tuner has settled their length
    bucket (one pass where the cost model alone decides; at most `EXPLORE_PASSES`), so that a
    timed "auto" pass runs what the tuner settled on, not a trial split; the passes it ran."""
    planner = runner.planner
    assert planner is not None
    for done in range(1, EXPLORE_PASSES + 1):
        prefill_speed(runner, length, vocab, 1)
        if planner.tuner.settled(planner.tuner.bucket(length)):
            return done
    return EXPLORE_PASSES


def h2d_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a pinned host-to-device copy of `gib` GiB (best of `repeats`)."""
    host = torch.empty(int(gib * 2**30), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return host.numel() / best


def count_launches(runner: ModelRunner, prompt: list[int], steps: int) -> dict[str, float]:
    """CUDA runtime launches, GPU kernels and host syncs per decoded token (torch.profiler over
    `steps` decode steps after two warm-up steps)."""
    slot = runner.cache.allocate()
    try:
        token = first_token(runner, slot, prompt)
        for _ in range(2):
            token = next_token(runner, slot, token)
        sync(runner.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                token = next_token(runner, slot, token)
            sync(runner.device)
    finally:
        runner.cache.free(slot)
    names: Counter[str] = Counter()
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += not event.name.startswith(("Memcpy", "Memset"))
        else:
            names[event.name] += 1
    launches = sum(names[n] for n in LAUNCH_CALLS)
    return {
        "launch_calls_per_token": launches / steps,
        "kernel_launches_per_token": sum(names[n] for n in LAUNCH_CALLS[:4]) / steps,
        "graph_launches_per_token": names["cudaGraphLaunch"] / steps,
        "host_functions_per_token": names["cudaLaunchHostFunc"] / steps,
        "gpu_kernels_per_token": kernels / steps,
        "host_syncs_per_token": sum(names[n] for n in SYNC_CALLS) / steps,
    }


def cpu_experts_ms(model: nn.Module, repeats: int = 10) -> float:
    """Milliseconds per token of the routed experts alone: each MoE layer's `CpuMoE.forward` on
    one token with K distinct random experts, layer after layer as decode reads them (fresh
    experts each repeat, median over repeats). Step time minus this is the runtime's share."""
    layers = [(cpu_moe_of(m.experts), m.gate.config.top_k) for m in moe_layers(model)]
    generator = torch.Generator().manual_seed(1)
    dtype = moe_layers(model)[0].gate.weight.dtype
    times = [cpu_experts_pass_s(layers, generator, dtype) for _ in range(repeats + 2)]
    return statistics.median(times[2:]) * 1e3  # after two warm-up passes


def cpu_experts_pass_s(layers: list[tuple[Any, int]], generator: torch.Generator,
                       dtype: torch.dtype) -> float:
    """Seconds of one token through every (CpuMoE, top-k) of `layers` in turn, each on k distinct
    random experts (inputs drawn before the clock starts)."""
    calls = []
    for moe, k in layers:
        x = torch.randn(1, moe.hidden, generator=generator).to(dtype)  # [1, H]
        ids = torch.randperm(moe.num_experts, generator=generator)[:k][None]  # [1, K]
        weights = torch.rand(1, k, generator=generator)  # [1, K]
        calls.append((moe, x, ids, weights / weights.sum()))
    start = time.perf_counter()
    for moe, x, ids, weights in calls:
        moe.forward(x, ids, weights)
    return time.perf_counter() - start
