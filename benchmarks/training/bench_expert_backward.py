"""Speed of the CPU experts' backward for training (experts/expert_grad.py, csrc/moe/backward_job.h)
per weight format and math (fp32 x: fp32 math; bf16 x: the bf16 math of bf16 training, AMX
tiles where an expert has enough rows), and of the fp32 forward it shares its recompute with.

Shape (default): E=16 experts, H=1024, I=512, 512 tokens, top-4, uniform random routing (every
expert ~128 rows). Per format: the median of the timed `expert_backward` calls (--calls per round
after warm-up, --rounds rounds) in ms, and GFLOP/s counted as the backward's minimal work per
(token, expert) pair, the same count for every build (so two builds' GFLOP/s ratio is their
time ratio):
    recompute gate/up   x [H] . W_gate_up^T [H, 2I]    4 H I
    dA = dY W_down      dY [H] . W_down [H, I]         2 H I
    dx = [dg, du] W_gate_up   [2I] . [2I, H]           4 H I
    total 10 H I; the SiLU, dweights and the combine are not counted. (Builds before the GEMM
    backward also computed y = W_down h for dweights = <dY, y>, 2 H I more; <dA, h> is the
    same number.) The fp32 forward (`expert_forward_fp32`) counts 6 H I: gate/up and down.

`--baseline DIR` runs the same measurements on another build of hetmoe in a subprocess (DIR
holds its `hetmoe` package, e.g. an unpacked wheel of an earlier commit), alternating with this
build (round by round), and reports the speedups.

    python benchmarks/training/bench_expert_backward.py [--formats bf16,int8,int4,fp8]
        [--tokens 512] [--threads 2] [--calls 5] [--rounds 3] [--baseline DIR] [--json out.json]
        [--label TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

FORMATS = ("bf16", "int8", "int4", "fp8")
GROUPS = {"bf16": None, "int8": 32, "int4": 32, "fp8": 128}


def build_layer(fmt: str, e: int, h: int, i: int, threads: int):  # noqa: ANN201 (CpuMoE)
    """A CpuMoE with random weights (fp8: e4m3 codes with 128x128 block scales)."""
    from hetmoe.experts.cpu_moe import CpuMoE

    g = torch.Generator().manual_seed(0)
    moe = CpuMoE(e, h, i, fmt, group_size=GROUPS[fmt], threads=threads)
    shapes = ((e, i, h), (e, i, h), (e, h, i))
    if fmt == "fp8":
        codes = [torch.randn(s, generator=g).to(torch.float8_e4m3fn) for s in shapes]
        scales = [torch.full((s[0], -(-s[1] // 128), -(-s[2] // 128)), 0.03) for s in shapes]
        moe.load(*codes, *scales, fp8_block=(128, 128))
    else:
        gate, up, down = (torch.randn(s, generator=g) * 0.03 for s in shapes)
        moe.load(gate, up, down)
    return moe


def measure(fmt: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """ms of each of args.calls backward and fp32 forward calls on this process's hetmoe."""
    from hetmoe.experts.expert_grad import expert_backward, expert_forward_fp32

    e, h, i, t, k = args.experts, args.hidden, args.intermediate, args.tokens, args.top_k
    moe = build_layer(fmt, e, h, i, args.threads)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    weights = torch.rand(t, k, generator=g)
    dy = torch.randn(t, h, generator=g)
    result = {}
    xb = x.bfloat16()
    for name, fn in (("backward", lambda: expert_backward(moe, x, ids, weights, dy)),
                     ("backward_bf16", lambda: expert_backward(moe, xb, ids, weights, dy)),
                     ("forward_fp32", lambda: expert_forward_fp32(moe, x, ids, weights))):
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        result[name] = times
    return result


def measure_baseline(fmt: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """`measure` in a subprocess whose `hetmoe` is the build under args.baseline."""
    argv = ["--one", fmt]
    for name in ("experts", "hidden", "intermediate", "tokens", "top_k", "threads", "calls",
                 "warmup"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # An editable install's import hook would win over sys.path: drop it in the child.
    code = ("import sys, runpy; sys.meta_path = [f for f in sys.meta_path if 'editable' not in "
            f"type(f).__module__]; sys.path.insert(0, {str(args.baseline)!r}); "
            f"sys.argv = {[__file__] + argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def git_sha() -> str:
    from hetmoe.machine import source_commit

    return source_commit(Path(__file__).resolve().parents[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="dir holding another build's hetmoe package")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # subprocess mode: one format, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return
    from hetmoe import _cpu
    from hetmoe.machine import machine_report

    formats = [f for f in args.formats.split(",") if f]
    pairs = args.tokens * args.top_k
    flops = {"backward": 10.0 * args.hidden * args.intermediate * pairs,
             "backward_bf16": 10.0 * args.hidden * args.intermediate * pairs,
             "forward_fp32": 6.0 * args.hidden * args.intermediate * pairs}
    rows = []
    header = f"{'format':6} {'pass':13} {'ms':>8} {'GFLOP/s':>8}"
    if args.baseline:
        header += f" {'base ms':>8} {'base GF/s':>9} {'speedup':>7}"
    print(f"E={args.experts} H={args.hidden} I={args.intermediate} tokens={args.tokens} "
          f"top-{args.top_k} threads={args.threads} isa={_cpu.best_isa()}")
    print(header)
    for fmt in formats:
        # Rounds alternate the two builds, so a drift of the (shared) machine hits both alike.
        now: dict[str, list[float]] = {name: [] for name in flops}
        base: dict[str, list[float]] = {name: [] for name in flops}
        for _ in range(args.rounds):
            for name, times in (measure_baseline(fmt, args) if args.baseline else {}).items():
                base[name] += times
            for name, times in measure(fmt, args).items():
                now[name] += times
        for name, samples in now.items():
            if not samples:
                continue
            ms = statistics.median(samples)
            row = {"format": fmt, "pass": name, "ms": ms, "gflops": flops[name] / ms / 1e6}
            line = f"{fmt:6} {name:13} {ms:8.1f} {row['gflops']:8.1f}"
            if args.baseline and base[name]:
                bms = statistics.median(base[name])
                row.update(base_ms=bms, base_gflops=flops[name] / bms / 1e6, speedup=bms / ms)
                line += f" {bms:8.1f} {row['base_gflops']:9.1f} {row['speedup']:6.2f}x"
            rows.append(row)
            print(line, flush=True)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "one")}
        config["baseline"] = str(args.baseline) if args.baseline else None
        report = {"label": args.label, "git": git_sha(), "config": config,
                  "flops_per_pair": {"backward": "10 H I", "forward_fp32": "6 H I"},
                  "machine": machine_report(), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
