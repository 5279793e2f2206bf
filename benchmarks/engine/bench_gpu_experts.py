"""Decode speed against the GPU expert budget (engine/placement.py), one model build, one process.

For each budget (GB of packed experts resident on the GPU; `all` = every expert) the runner is
re-placed (`ModelRunner.place`) and a greedy decode timed (median step, first step untimed). The
floor of each row: the CPU reads the misses' bytes per token at the host's measured read
bandwidth (before the build), the GPU its resident experts' bytes at HBM speed, so
floor_tok_s = 1 / max(cpu_bytes / host_bw, gpu_bytes / hbm_bw) (the rest of the step, attention
and launches, comes on top: `no_cpu_work` of hetmoe bench says how much).

    python benchmarks/engine/bench_gpu_experts.py --shape qwen3-30b-a3b --weight-format int8 \\
        --budgets 0,8,15,23,all --json gpu_experts.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.harness import _git_sha, _machine, _now
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.placement_compute import use_kernel
from hetmoe.engine.placement_policy import TrafficPolicy
from hetmoe.engine.runner import ModelRunner

GB = 1e9


def hbm_read_gb_s(device: torch.device, gib: float = 4.0) -> float:
    """GPU memory read bandwidth: best of 5 sums over a `gib` GiB tensor."""
    data = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        data.sum(dtype=torch.float32)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del data
    return int(gib * 2**30) / best / GB


def profile_steps(runner: ModelRunner, prompt: list[int], steps: int = 16) -> dict[str, Any]:
    """GPU time per kernel name of `steps` greedy graph steps alone: a run of steps + 1 tokens
    minus a run of 1 (the prompt's prefill and the first step cancel out). Returns the kernels
    per step, the GPU busy time per step and the top 30 names [(name, calls/step, us/step)]."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(tokens: int) -> dict[str, tuple[int, float]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            measure.greedy_decode(runner, prompt, tokens)
        return {e.key: (e.count, e.device_time_total) for e in prof.key_averages()
                if e.device_time_total > 0}

    measure.greedy_decode(runner, prompt, 4)  # graphs captured before profiling
    base, full = kernels(2), kernels(steps + 2)
    rows = [(name, (calls - base.get(name, (0, 0.0))[0]) / steps,
             (us - base.get(name, (0, 0.0))[1]) / steps) for name, (calls, us) in full.items()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    count = sum(r[1] for r in rows)
    print(f"GPU busy {busy:.0f} us/step over {count:.0f} kernels/step")
    for name, calls, us in rows[:30]:
        print(f"{us:9.1f} us/step {calls:6.1f} calls/step  {name[:90]}")
    return {"busy_us_per_step": round(busy, 1), "kernels_per_step": round(count, 1),
            "top": [(name[:120], round(calls, 2), round(us, 1)) for name, calls, us in rows[:30]]}


PEER_TG128 = {"0": 28.0, "8": 30.6, "15": 43.2, "23": 65.8, "all": 255.2}
"""llama.cpp Q8_0 tg128 with `-ngl 99 -ncmoe N -t 15` per budget (12 / 24 / 36 / 48 layers'
experts on the GPU), from issue 27's lease on the same machine type (not this run)."""


def plot(result: dict[str, Any], path: str) -> None:
    """Decode tok/s against the GB of experts on the GPU, per deferral, static placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["placement_interval"] == 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({r["deferred"] for r in rows}):
        mine = [r for r in rows if r["deferred"] == d]
        ax.plot([r["gpu_expert_bytes"] / GB for r in mine], [r["tok_s"] for r in mine], "o-",
                label=f"hetmoe INT8, deferred={d}")
    peer = [r for r in rows if r["deferred"] == 0 and r["budget"] in PEER_TG128]
    ax.plot([r["gpu_expert_bytes"] / GB for r in peer], [PEER_TG128[r["budget"]] for r in peer],
            "s--", label="llama.cpp Q8_0 -ncmoe (issue 27, other lease)")
    ax.set_xlabel("routed experts on the GPU (GB)")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(f"Qwen3-30B-A3B shape, {result['machine']['gpu']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--weight-format", default="int8")
    p.add_argument("--budgets", default="0,8,15,23,all", help="GB per row, or all")
    p.add_argument("--deferred", default="0", help="Expert Deferral values per budget")
    p.add_argument("--intervals", default="0",
                   help="placement_interval values per budget (0: static placement)")
    p.add_argument("--profile", action="store_true",
                   help="GPU kernels of 16 graph steps at the last budget (torch.profiler)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --json of an earlier run: only draw its PNG (no GPU needed)")
    args = p.parse_args()
    if args.plot:
        with open(args.json) as f:
            plot(json.load(f), args.plot)
        return
    device = torch.device("cuda")
    host_gb_s = measure.read_bandwidth(2.0)
    hbm = hbm_read_gb_s(device)
    config = shape_config(args.shape, args.num_layers)
    start = time.perf_counter()
    model = build_random_model(config, device, torch.bfloat16, "cpu", args.weight_format, 0)
    build_s = time.perf_counter() - start
    routed = measure.routed_bytes_per_token(model)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    window = args.prompt_len + args.new_tokens + 8
    runner = ModelRunner(model, device, torch.bfloat16, 1, window,
                         EngineConfig(gpu_expert_bytes=0))
    result: dict[str, Any] = {
        "command": "benchmarks/engine/bench_gpu_experts.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "date": _now(), "git": _git_sha(), "machine": _machine(device),
        "host_read_gb_s": round(host_gb_s, 1), "hbm_read_gb_s": round(hbm, 1),
        "build_s": round(build_s, 1), "routed_bytes_per_token": routed,
        "gpu_compute": ("triton packed_moe" if use_kernel(device, args.weight_format)
                        else "torch (unpack + bmm)"),
        "rows": [],
    }
    print(f"host {host_gb_s:.1f} GB/s, HBM {hbm:.0f} GB/s, built in {build_s:.1f} s, "
          f"{routed / 1e6:.1f} MB of routed experts per token, GPU compute: "
          f"{result['gpu_compute']}", flush=True)
    base_tokens: list[int] | None = None
    for budget in args.budgets.split(","):
        asked = 10**15 if budget == "all" else int(float(budget) * GB)
        plan = runner.place(asked)
        share = plan.gpu_share()
        gpu_bytes, cpu_bytes = routed * share, routed * (1 - share)
        floor = 1 / max(cpu_bytes / (host_gb_s * GB), gpu_bytes / (hbm * GB), 1e-9)
        settings = [(int(d), int(n)) for d in args.deferred.split(",")
                    for n in args.intervals.split(",")]
        for d, interval in settings:
            runner.reset_graphs(d)
            runner.policy = None
            for slots in runner.placement.layers if runner.placement is not None else []:
                slots.counting = False  # a policy below turns it on again
            if interval and runner.placement is not None and not plan.everything:
                runner.policy = TrafficPolicy(runner.placement, interval)
            run = measure.greedy_decode(runner, prompt, args.new_tokens)
            if base_tokens is None:
                base_tokens = run.tokens
            same = next((i for i, (a, b) in enumerate(zip(run.tokens, base_tokens,
                                                                strict=True)) if a != b),
                        len(run.tokens))
            row = {"budget": budget, "deferred": d, "placement_interval": interval,
                   "moves": runner.policy.moves if runner.policy is not None else 0,
                   "gpu_expert_bytes": plan.bytes,
                   "experts_per_layer": [len(r) for r in plan.resident][:1] + [
                       min(len(r) for r in plan.resident)],
                   "gpu_share": round(share, 4), "cpu_bytes_per_token": int(cpu_bytes),
                   "floor_tok_s": round(floor, 1), "tok_s": round(run.tok_s, 2),
                   "mean_tok_s": round(run.mean_tok_s, 2),
                   "of_floor": round(run.tok_s / floor, 3),
                   "tokens_equal_budget0_first": same,
                   "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / GB, 2)}
            result["rows"].append(row)
            print(f"budget {budget:>4} GB d={d} interval {interval}: {plan.bytes / GB:6.2f} GB "
                  f"resident, {row['moves']} moves "
                  f"({share:.1%} of routed work), {run.tok_s:7.2f} tok/s, floor "
                  f"{floor:7.1f} ({row['of_floor']:.0%}), tokens equal to budget 0's for "
                  f"{same}/{len(run.tokens)}", flush=True)
    if args.profile:
        result["profile"] = profile_steps(runner, prompt)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
