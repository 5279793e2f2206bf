"""bench/gpu_profile.py on the CPU: the sums of canned profiler events, a longer run minus a
shorter one, and the real profiler's CPU events of a callable and of a baby runner's decode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from hetmoe.bench.gpu_profile import (
    KernelProfile,
    KernelRow,
    decode_kernels,
    kernel_profile,
    summed,
)
from hetmoe.bench.random_model import build_random_model
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.presets.tiny import tiny_config


def event(name: str, device: DeviceType, us: float) -> SimpleNamespace:
    """A profiler event as `summed` reads it (a CPU event's time is its CPU time)."""
    return SimpleNamespace(name=name, device_type=device, device_time_total=us,
                           cpu_time_total=us if device == DeviceType.CPU else 0.0)


def test_device_events_are_summed_per_name_and_run() -> None:
    cuda = DeviceType.CUDA
    events = [event("gemm_bf16", cuda, 10.0), event("cudaGraphLaunch", DeviceType.CPU, 99.0),
              event("Memcpy HtoD", cuda, 4.0), event("gemm_bf16", cuda, 20.0),
              event("rmsnorm_a", cuda, 1.0), event("rmsnorm_b", cuda, 2.0)]
    profile = summed(events, DeviceType.CUDA, runs=2)
    assert profile.rows == (KernelRow("gemm_bf16", 1.0, 15.0), KernelRow("Memcpy HtoD", 0.5, 2.0),
                            KernelRow("rmsnorm_b", 0.5, 1.0), KernelRow("rmsnorm_a", 0.5, 0.5))
    assert (profile.busy_us, profile.calls, profile.kernels) == (18.5, 2.5, 2.0)
    # Cut to 7 characters, the two norms are one name (the launch on the CPU still left out).
    cut = summed(events, DeviceType.CUDA, runs=2, name_width=7)
    assert cut.rows == (KernelRow("gemm_bf", 1.0, 15.0), KernelRow("Memcpy ", 0.5, 2.0),
                        KernelRow("rmsnorm", 1.0, 1.5))
    assert summed(events, DeviceType.CPU, runs=1).rows == (KernelRow("cudaGraphLaunch", 1, 99.0),)


def test_minus_keeps_what_the_longer_run_added_per_step() -> None:
    full = KernelProfile((KernelRow("gemm", 34.0, 340.0), KernelRow("prefill", 3.0, 900.0),
                          KernelRow("argmax", 18.0, 36.0)))
    base = KernelProfile((KernelRow("gemm", 2.0, 20.0), KernelRow("prefill", 3.0, 880.0),
                          KernelRow("argmax", 2.0, 4.0)))
    step = full.minus(base, runs=16)
    # prefill ran as often in both (its time noise left aside): no calls left, dropped.
    assert step.rows == (KernelRow("gemm", 2.0, 20.0), KernelRow("argmax", 1.0, 2.0))
    assert (step.busy_us, step.calls) == (22.0, 3.0)


def test_the_cpu_profiler_counts_each_op_per_run() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def run() -> None:
        torch.mm(a, b)
        torch.mm(b, a)
        torch.add(a, b)

    profile = kernel_profile(run, 3, ProfilerActivity.CPU)
    rows = {r.name: r for r in profile.rows}
    assert (rows["aten::mm"].calls, rows["aten::add"].calls) == (2.0, 1.0)
    assert rows["aten::mm"].us > 0
    assert profile.busy_us == pytest.approx(sum(r.us for r in profile.rows))
    assert [r.us for r in profile.rows] == sorted((r.us for r in profile.rows), reverse=True)


def test_decode_kernels_profiles_steps_of_one_slot_and_frees_it() -> None:
    torch.manual_seed(0)
    model = build_random_model(tiny_config("qwen3_moe"), torch.device("cpu"), torch.bfloat16,
                               "torch-cpu", "bf16")
    runner = ModelRunner(model, torch.device("cpu"), torch.bfloat16, 2, 32)
    free = runner.cache.free_slots
    one = decode_kernels(runner, [5, 9, 33], 1, warmup=1, activity=ProfilerActivity.CPU)
    three = decode_kernels(runner, [5, 9, 33], 3, warmup=1, activity=ProfilerActivity.CPU)
    assert runner.cache.free_slots == free
    # A decode step runs the same ops every time: the same calls per step over 1 or 3 steps.
    layers = model.config.num_hidden_layers
    calls = {r.name: r.calls for r in one.rows}
    assert calls == {r.name: r.calls for r in three.rows}
    assert calls["aten::argmax"] == 1.0  # the token read on the host, once per step
    assert calls["aten::mm"] >= layers  # at least one matrix product per layer
