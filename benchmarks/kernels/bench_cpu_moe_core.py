"""Single-core CpuMoE kernel throughput (prefill shape), for tuning on a machine with few cores.

One pool worker runs a Qwen3-30B-A3B-shaped layer (H=2048, I=768, top-8) with E experts and q
tokens, so each expert gets q * 8 / E rows on average (default 128, as at q=2048 with E=128).
Prints, per format, the median (and best) on-CPU time of the worker per call (from the kernel's
schedstat, so time-sharing the core with other processes does not count), TFLOPS (BF16) or TOPS
(INT) per core, and the per-phase wall times (convert, gather, gate/up, down, combine) of one
profiled call. The 16-core targets are 9 TFLOPS BF16 and 12 TOPS INT8, i.e. ~0.56 TFLOPS and
~0.75 TOPS per core.

Usage: python benchmarks/kernels/bench_cpu_moe_core.py [--experts 16] [--q 256] [--calls 7]
           [--formats bf16,int8,int4] [--isa amx]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading

import torch

from hetmoe import _cpu_testing
from hetmoe.experts import CpuMoE


def cpu_ns_per_thread() -> dict[int, int]:
    """On-CPU nanoseconds of each thread of this process (Linux schedstat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:
            continue
    return out


def worker_seconds(call) -> float:
    """On-CPU seconds of the busiest thread other than the caller during `call()`."""
    me = threading.get_native_id()
    before = cpu_ns_per_thread()
    call()
    after = cpu_ns_per_thread()
    return max(after[t] - before.get(t, 0) for t in after if t != me) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--q", type=int, default=256)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--formats", default="bf16,int8,int4")
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    E, H, I, K, q = args.experts, 2048, 768, 8, args.q
    g = torch.Generator().manual_seed(0)
    src = tuple(torch.randn(E, *s, generator=g).div_(s[1] ** 0.5).bfloat16()
                for s in ((I, H), (I, H), (H, I)))
    x = torch.randn(q, H, generator=g).bfloat16()
    ids = torch.randn(q, E, generator=g).topk(K, dim=1).indices.contiguous()
    wts = torch.full((q, K), 1.0 / K)
    flops = 3 * 2 * H * I * q * K
    for fmt in args.formats.split(","):
        moe = CpuMoE(E, H, I, fmt, threads=1, isa=args.isa, amx_min_tokens=1)
        moe.load(*src)
        for _ in range(2):
            moe.forward(x, ids, wts)
        call = functools.partial(moe.forward, x, ids, wts)
        samples = [worker_seconds(call) for _ in range(args.calls)]
        sec, best = statistics.median(samples), min(samples)
        _cpu_testing.set_profile(moe._layer, True)
        moe.forward(x, ids, wts)
        _cpu_testing.set_profile(moe._layer, False)
        phases = " / ".join(f"{v:.0f}" for v in _cpu_testing.phase_us(moe._layer))
        print(f"{fmt:5} isa={moe.isa:6} q={q} E={E}: median {sec * 1e3:7.2f} ms "
              f"{flops / sec / 1e12:6.3f} T(FL)OPS/core, best {flops / best / 1e12:6.3f}; "
              f"phases us {phases}", flush=True)


if __name__ == "__main__":
    main()
