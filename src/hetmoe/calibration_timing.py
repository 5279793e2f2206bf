"""The timings a `calibration.MachineProfile` is made of: one small CpuMoE call, a layer's
routed experts per packed format on the CPU and on the GPU (a line over two token counts: fixed
cost per expert, cost per (token, expert) pair), and pinned copies and host reads from the GPU.
Random weights; best of `repeats` runs."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.gpu_view import gpu_view
from hetmoe.experts.packed_layout import host_tensor, unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp
from hetmoe.kernels.packed_moe import packed_moe
from hetmoe.kernels.prefill_path import unpack_reason


def call_seconds(calls: int = 50) -> float:
    """Best submit + sync of a 1-token call to one expert of a tiny layer (weights in cache)."""
    moe = CpuMoE(4, 64, 64)
    gen = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(4, 64, 64, generator=gen, dtype=torch.bfloat16)
                      for _ in range(3))
    moe.load(gate, up, down)
    x = torch.randn(1, 64, generator=gen, dtype=torch.bfloat16)
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    best = float("inf")
    for _ in range(calls + 5):  # the first calls wake the pool and allocate
        start = time.perf_counter()
        moe.sync(moe.submit(x, ids, weights))
        best = min(best, time.perf_counter() - start)
    return best


def random_weights(experts: int, hidden: int, intermediate: int) -> tuple[torch.Tensor, ...]:
    """gate, up [E, I, H] and down [E, H, I] bf16, N(0, 0.02) as a trained layer's scale."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((experts, intermediate, hidden),) * 2 + ((experts, hidden, intermediate),)
    return tuple((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for s in shapes)


def loaded_moe(fmt: str, weights: tuple[torch.Tensor, ...]) -> CpuMoE:
    gate, up, down = weights
    moe = CpuMoE(gate.shape[0], gate.shape[2], gate.shape[1], fmt)
    if fmt != "fp8":
        moe.load(gate, up, down)
        return moe
    # An FP8 checkpoint's codes with unit block scales (packed as stored, never requantized).
    codes = [w.float().mul(64).to(torch.float8_e4m3fn) for w in weights]
    scales = [torch.full((w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128)), 1 / 64)
              for w in weights]
    moe.load(codes[0], codes[1], codes[2], scales[0], scales[1], scales[2])
    return moe


def line(seconds: tuple[float, float], tokens: tuple[int, int]) -> tuple[float, float]:
    """(intercept, slope) of the line through (tokens[i], seconds[i]), both kept positive
    (noise on tiny layers can flatten or invert it)."""
    slope = (seconds[1] - seconds[0]) / (tokens[1] - tokens[0])
    slope = max(slope, 0.05 * seconds[1] / tokens[1])
    return max(seconds[0] - slope * tokens[0], 0.05 * seconds[0]), slope


def cpu_line(moe: CpuMoE, experts: int, tokens: tuple[int, int],
              repeats: int) -> tuple[float, float]:
    """(seconds per expert beyond its products, seconds per (token, expert) pair) of `moe`'s
    kernels: `experts` experts with tokens[0] then tokens[1] tokens each, each repeat on the
    next window of experts (weights from DRAM), best of `repeats`."""
    seconds = []
    for n in tokens:
        x = torch.randn(experts * n, moe.hidden, generator=torch.Generator().manual_seed(n))
        x = x.to(torch.bfloat16)  # [e n, H]
        weights = torch.ones(experts * n, 1)
        window = torch.arange(experts).repeat_interleave(n)[:, None]  # [e n, 1]
        moe.forward(x, window, weights)  # warm-up: workspace, pool awake
        best = float("inf")
        for r in range(repeats):
            ids = window + experts * ((r + 1) % (moe.num_experts // experts))
            start = time.perf_counter()
            moe.forward(x, ids, weights)
            best = min(best, time.perf_counter() - start)
        seconds.append(best / experts)
    return line((seconds[0], seconds[1]), tokens)


def gpu_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best of `repeats` GPU times of `fn`'s work on the device's current stream (a warm-up
    first), read from CUDA events."""
    stream = torch.cuda.current_stream(device)
    fn()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def gpu_line(moe: CpuMoE, experts: int, device: torch.device, tokens: tuple[int, int],
              repeats: int) -> tuple[float, float]:
    """(fixed seconds per expert, seconds per (token, expert) pair) on the GPU of `experts` of
    `moe`'s packed experts, resident on `device`, computed for tokens[0] then tokens[1] tokens
    each as engine/placement/layer_stream.py's `LayerStreamer.start` does: the packed kernels where
    they run, else unpacked and a grouped GEMM."""

    grouped = grouped_mm_available(device)
    packed = not unpack_reason(device, moe.weight_format)
    seconds = []
    with torch.cuda.device(device):
        parts = moe.packed_groups()
        raws = [host_tensor(p)[:experts * p.expert_bytes].to(device).view(experts,
                                                                         p.expert_bytes)
                for p in parts]
        gen = torch.Generator(device).manual_seed(2)
        for n in tokens:
            x = torch.randn(experts * n, moe.hidden, generator=gen, device=device,
                            dtype=torch.bfloat16)  # [e n, H]
            ids = torch.arange(experts, device=device).repeat_interleave(n)[:, None]
            weights = torch.ones(experts * n, 1, device=device)

            def step(x: torch.Tensor = x, ids: torch.Tensor = ids,
                     weights: torch.Tensor = weights) -> torch.Tensor:
                if packed:
                    outs = [packed_moe(x, ids, weights, raw.view(-1), part, moe.weight_format,
                                       moe.hidden, moe.group_size)
                            for raw, part in zip(raws, parts, strict=True)]
                    return torch.stack(outs).sum(0) if len(outs) > 1 else outs[0]
                unpacked = [unpack_group(raw, part, moe.weight_format, moe.hidden,
                                         moe.group_size)
                            for raw, part in zip(raws, parts, strict=True)]
                return routed_mlp(x, ids, weights, unpacked, grouped)

            seconds.append(gpu_seconds(step, device, repeats) / experts)
    return line((seconds[0], seconds[1]), tokens)


def copy_rates(device: torch.device, size: int, repeats: int) -> tuple[float, float]:
    """(host -> GPU, GPU -> host) bytes/s of `size`-byte copies between pinned host memory and
    the device."""
    with torch.cuda.device(device):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(size, dtype=torch.uint8, device=device)
        h2d = gpu_seconds(lambda: gpu.copy_(host, non_blocking=True), device, repeats)
        d2h = gpu_seconds(lambda: host.copy_(gpu, non_blocking=True), device, repeats)
    return size / h2d, size / d2h


def host_read_rate(device: torch.device, size: int, repeats: int) -> float:
    """Bytes/s of a GPU sum over `size` bytes of pinned host memory read in place."""
    with torch.cuda.device(device):
        host = torch.ones(size // 2, dtype=torch.bfloat16, pin_memory=True)
        view = gpu_view(host, device)
        seconds = gpu_seconds(lambda: view.sum(dtype=torch.float32), device, repeats)
    return size / seconds
