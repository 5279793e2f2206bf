"""Per-layer cost of handing work from a GPU stream to the CPU experts and back (needs CUDA).

A CUDA graph of `--layers` fake MoE layers, each: one small GPU kernel -> copies of x, ids and
weights to the layer's pinned buffers -> CPU start -> CPU wait -> output copied back -> one GPU
add. Timed per layer (median of replays) for:
- `copies`: the copies alone, no CPU work (the floor of the transport);
- `host_functions`: CPU work started/awaited by cudaLaunchHostFunc (the driver's callback thread);
- `flags`: ready/done words with stream memory operations, jobs queued before the replay;
- `cpu_alone`: the same CPU call from Python without any GPU (`CpuMoE.forward`);
- `copies_packed` / `flags_packed`: as `copies` / `flags`, the inputs packed on the GPU into one
  staging vector (ops/fused.py) and moved with ONE copy (the fused decode's transport);
- `flags_empty` / `cpu_empty_alone`: every expert masked out, so the job routes nothing: the
  ready/done round trip alone (from the GPU) and the empty call alone (from Python).
The CPU call is a real `CpuMoE` (8 experts, H=2048, I=`--intermediate`, bf16, top-8) so the job
goes through routing and every phase; a small I keeps its compute short, so the transport shows.

    python benchmarks/bench_signal.py [--layers 48] [--intermediate 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hetmoe.engine.host_link import HostLink
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.ops.fused import pack_moe_inputs

H, E, K = 2048, 8, 8


class Queue:
    """Records flag jobs at capture; submits them before each replay; waits them after."""

    def __init__(self) -> None:
        self.recorded: list[tuple[HostLink, int]] = []
        self.handles: list[tuple[HostLink, int]] = []

    def __call__(self, link: HostLink, deferred: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            self.recorded.append((link, deferred))
        else:
            self.handles.append((link, link.submit(deferred)))

    def submit(self) -> None:
        self.handles = [(link, link.submit(d)) for link, d in self.recorded]

    def wait(self) -> None:
        for link, handle in self.handles:
            link.moe.wait_flagged(handle)
        self.handles = []


def step(x: torch.Tensor, links: list[HostLink], ids: torch.Tensor, weights: torch.Tensor,
         mode: str) -> torch.Tensor:
    for link in links:
        y = x * 1.0001  # [1, H]
        if mode.endswith("packed") or mode == "flags_empty":
            stage = pack_moe_inputs(y, ids, weights)  # one GPU kernel, as the fused layer's tail
            if mode == "copies_packed":
                link.stage[:stage.numel()].copy_(stage, non_blocking=True)
                out = link.out[:1].to(x.device, non_blocking=True)
            else:
                link.start_packed(stage, 1)
                out = link.finish()
        elif mode == "copies":
            link.x[:1].copy_(y, non_blocking=True)
            link.ids[:1].copy_(ids, non_blocking=True)
            link.weights[:1].copy_(weights, non_blocking=True)
            out = link.out[:1].to(x.device, non_blocking=True)
        else:
            link.start(y, ids, weights)
            out = link.finish()
        x = y + out * 0.0
    return x


def time_mode(mode: str, moes: list[CpuMoE], replays: int) -> float:
    """Median µs per layer of `replays` graph replays."""
    device = torch.device("cuda")
    queue = Queue()
    signal = "flags" if mode.startswith("flags") else "host_functions"
    packed = mode.endswith("packed") or mode == "flags_empty"
    links = [HostLink(m, 1, K, torch.bfloat16, device, signal, queue, packed) for m in moes]
    ids = torch.arange(K, device=device).view(1, K)
    weights = torch.full((1, K), 1.0 / K, device=device)
    x = torch.randn(1, H, device=device, dtype=torch.bfloat16)
    for link in links:
        link.bind(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x, links, ids, weights, mode)  # warm-up, eager
    torch.cuda.synchronize()
    queue.wait()
    graph = torch.cuda.CUDAGraph()
    queue.recorded = []
    with torch.cuda.graph(graph):
        step(x, links, ids, weights, mode)
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        queue.submit()
        graph.replay()
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()
        times.append(time.perf_counter() - start)
        queue.wait()
    return statistics.median(times[3:]) / len(moes) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--intermediate", type=int, default=64)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure here")
        return 2
    torch.manual_seed(0)
    i = args.intermediate
    moes = []
    for _ in range(args.layers):
        moe = CpuMoE(E, H, i)
        moe.load(torch.randn(E, i, H, dtype=torch.bfloat16) * 0.02,
                 torch.randn(E, i, H, dtype=torch.bfloat16) * 0.02,
                 torch.randn(E, H, i, dtype=torch.bfloat16) * 0.02)
        moes.append(moe)
    x = torch.randn(1, H, dtype=torch.bfloat16)
    ids, weights = torch.arange(K).view(1, K), torch.full((1, K), 1.0 / K)

    def python_calls_us() -> float:
        """Median µs per layer of the layers' `forward` called from Python, one after another."""
        times = []
        for _ in range(args.replays):
            start = time.perf_counter()
            for moe in moes:
                moe.forward(x, ids, weights)
            times.append(time.perf_counter() - start)
        return statistics.median(times) / len(moes) * 1e6

    result = {"layers": args.layers, "intermediate": i, "device": torch.cuda.get_device_name(),
              "us_per_layer": {"cpu_alone": python_calls_us()}}
    for mode in ("copies", "host_functions", "flags", "copies_packed", "flags_packed"):
        result["us_per_layer"][mode] = time_mode(mode, moes, args.replays)
    for moe in moes:  # every expert masked: the jobs route nothing (the signal's round trip)
        moe.set_gpu_experts(torch.ones(E, dtype=torch.bool))
    result["us_per_layer"]["cpu_empty_alone"] = python_calls_us()
    result["us_per_layer"]["flags_empty"] = time_mode("flags_empty", moes, args.replays)
    print(f"{'mode':<16} µs/layer   ({args.layers} layers, I={i}, {result['device']})")
    for mode, us in result["us_per_layer"].items():
        print(f"{mode:<16} {us:8.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
