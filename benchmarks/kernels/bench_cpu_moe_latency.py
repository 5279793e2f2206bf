"""Fixed per-call cost of CpuMoE decode: q=1 top-8 on a layer small enough to stay in cache.

With H=I=64 and 8 experts the weights (50-200 KB) stay in L2, so what remains per call is the
fixed cost: Python argument checks, routing, the pool's phases and their barriers. Prints the
10th-percentile microseconds per call (the low percentile keeps out most of the time-sharing of
a busy machine) of the public `CpuMoE.forward` (with a preallocated `out`) and of the C++ layer
called directly; their difference is the Python side.

Usage: python benchmarks/kernels/bench_cpu_moe_latency.py [--threads 1] [--calls 3000]
           [--formats bf16,int8,int4] [--hidden 64] [--intermediate 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from hetmoe.experts import CpuMoE
from hetmoe.experts.call_check import check_call


def low_us(fn, calls: int) -> float:
    """10th-percentile wall microseconds of `fn()` over `calls` calls, after calls / 10 warm-up
    calls."""
    for _ in range(calls // 10):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.quantiles(times, n=10)[0] / 1e3


def main() -> None:
    """Prints one row per format: forward us, raw C++ us, Python us."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=64)
    args = ap.parse_args()
    E, H, I, k = 8, args.hidden, args.intermediate, 8
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(E, I, H, generator=g) / H**0.5
    up = torch.randn(E, I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    x = torch.randn(1, H, generator=g).bfloat16()
    ids = torch.randperm(E, generator=g)[:k].reshape(1, k)
    weights = torch.rand(1, k, generator=g)
    out = torch.empty_like(x)
    print(f"E={E} H={H} I={I} q=1 top-{k}, {args.threads} worker(s), "
          f"10th percentile of {args.calls} calls")
    for fmt in args.formats.split(","):
        moe = CpuMoE(E, H, I, fmt, threads=args.threads)
        moe.load(gate, up, down)
        raw_args = check_call(moe.hidden, x, ids, weights, out)[1]
        fwd = low_us(functools.partial(moe.forward, x, ids, weights, out), args.calls)
        raw = low_us(functools.partial(moe._layer.forward, *raw_args), args.calls)
        print(f"{fmt:>5}: forward {fwd:7.1f} us   C++ layer {raw:7.1f} us   "
              f"Python {fwd - raw:5.1f} us", flush=True)


if __name__ == "__main__":
    main()
