"""End-to-end hybrid benchmark of one real shape: ours (BF16, INT8) and both baselines, one table.

Each mode runs `hetmoe bench --random-weights SHAPE` in its own process (one model build in host
memory at a time), writing `<out>/<shape>-<mode>.json`; this script then writes
`<out>/<shape>.json` (all results + ratios) and prints a markdown table.

    python benchmarks/engine/bench_hybrid.py --shape qwen3-30b-a3b --out DIR [--modes cpu-bf16,...]

Modes: cpu-bf16 (with deferral 0/2/3, eager, launches, trace), cpu-int8, torch-cpu (plain-torch
experts on the CPU, no graphs/overlap), accelerate (transformers + accelerate device_map).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("cpu-bf16", "cpu-int8", "torch-cpu", "accelerate")


def mode_args(mode: str, args: argparse.Namespace, out: Path) -> list[str]:
    """`hetmoe bench` arguments of one mode."""
    common = ["--random-weights", args.shape, "--prompt-len", str(args.prompt_len)]
    if args.num_layers:
        common += ["--num-layers", str(args.num_layers)]
    if mode.startswith("cpu-"):
        fmt = mode.split("-", 1)[1]
        extra = ["--experts", "cpu", "--weight-format", fmt, "--deferred", args.deferred,
                 "--gpu-expert-gib", "0",  # the CPU experts' path: none resident
                 "--new-tokens", str(args.new_tokens), "--prefill", args.prefill]
        if fmt == "bf16":
            extra += ["--trace", str(out / f"{args.shape}-trace.json")]
        if fmt != "bf16" or args.no_eager:
            extra += ["--no-eager"]
        elif args.no_alternatives:
            extra += ["--no-alternatives"]
        return common + extra
    tokens = args.baseline_tokens if mode == "torch-cpu" else args.accelerate_tokens
    prefill = ["--prefill", "128"] if mode == "torch-cpu" else ["--prefill", ""]
    return common + ["--experts", mode, "--new-tokens", str(tokens), *prefill]


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Headline ratios: of bound, deferral and graph speed-ups, over the baselines."""
    out: dict[str, Any] = {}
    # One bandwidth for every mode: the highest any process's plain reads (torch's sum, the
    # pool's read, the pool's reads around each decode) measured: the strictest bound.
    reads = [r.get(key, 0) for r in results.values() for key in ("read_gb_s", "pool_read_gb_s")]
    reads += [v for r in results.values() for e in r.get("decode", {}).values()
              for v in e.get("read_gb_s_around", [])]
    bandwidth = max(reads, default=0)
    out["read_gb_s_max"] = bandwidth
    ours = results.get("cpu-bf16", {}).get("decode", {})
    base = ours.get("graph_d0", {}).get("tok_s")
    for mode in ("cpu-bf16", "cpu-int8"):
        r = results.get(mode, {})
        decode = r.get("decode", {})
        if "graph_d0" in decode and bandwidth:
            bound = bandwidth * 1e9 / r["routed_bytes_per_token"]
            out[f"{mode}_bound_tok_s"] = round(bound, 2)
            for d in (0, 2, 3):
                if f"graph_d{d}" in decode:
                    out[f"{mode}_d{d}_of_bound"] = round(decode[f"graph_d{d}"]["tok_s"] / bound, 3)
                    if "of_adjacent_bound" in decode[f"graph_d{d}"]:
                        out[f"{mode}_d{d}_of_adjacent_bound"] = \
                            decode[f"graph_d{d}"]["of_adjacent_bound"]
            if "cpu_experts_ms_per_token" in r:
                out[f"{mode}_cpu_experts_alone_of_bound"] = round(
                    1e3 / r["cpu_experts_ms_per_token"] / bound, 3)
        if "graph_d0_host_functions" in decode and "graph_d0" in decode:
            out[f"{mode}_flags_over_host_functions"] = round(
                decode["graph_d0"]["tok_s"] / decode["graph_d0_host_functions"]["tok_s"], 3)
        if "graph_d0_module_path" in decode and "graph_d0" in decode:
            out[f"{mode}_fused_over_module_path"] = round(
                decode["graph_d0"]["tok_s"] / decode["graph_d0_module_path"]["tok_s"], 3)
        for name in ("graph_d0_no_cpu_work", "graph_d0_no_cpu_work_module_path"):
            if name in decode:
                out[f"{mode}_{name.replace('graph_d0_', '')}_ms_per_token"] = \
                    decode[name]["ms_per_token"]
        for d in (2, 3):
            if f"graph_d{d}" in decode and "graph_d0" in decode:
                out[f"{mode}_deferred{d}_speedup"] = round(
                    decode[f"graph_d{d}"]["tok_s"] / decode["graph_d0"]["tok_s"], 3)
    if base and "eager_d0" in ours:
        out["graph_over_eager"] = round(base / ours["eager_d0"]["tok_s"], 3)
    torch_cpu = results.get("torch-cpu", {}).get("decode", {}).get("torch-cpu", {}).get("tok_s")
    if base and torch_cpu:
        out["over_torch_cpu"] = round(base / torch_cpu, 2)
    acc = results.get("accelerate", {}).get("decode", {}).get("accelerate", {})
    if base and acc.get("decode_tok_s"):
        out["over_accelerate"] = round(base / acc["decode_tok_s"], 1)
    return out


def markdown(shape: str, results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    """The result table in markdown."""
    lines = [f"### {shape}", "", "| mode | decode tok/s | of bound | bound tok/s | notes |",
             "|---|---:|---:|---:|---|"]
    for mode, r in results.items():
        if "error" in r:
            lines.append(f"| {mode} | failed | | | {r['error'][:80]} |")
            continue
        for name, e in r.get("decode", {}).items():
            speed = e.get("tok_s", e.get("decode_tok_s"))
            share = e.get("of_bound", "")
            note = f"{e.get('timed_steps', e.get('new_tokens'))} tokens"
            if "of_adjacent_bound" in e:
                note += (f"; {e['of_adjacent_bound']} of the pool's reads around it "
                         f"({'/'.join(str(v) for v in e['read_gb_s_around'])} GB/s)")
            lines.append(f"| {mode} {name} | {speed:.2f} | {share} | "
                         f"{r.get('bound_tok_s', '')} | {note} |")
    lines += ["", "| mode | prefill length | tok/s |", "|---|---:|---:|"]
    for mode, r in results.items():
        for n, speed in r.get("prefill_tok_s", {}).items():
            lines.append(f"| {mode} | {n} | {speed} |")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in summary.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--deferred", default="0,2,3")
    parser.add_argument("--prefill", default="128,1024,4096")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--baseline-tokens", type=int, default=32)
    parser.add_argument("--accelerate-tokens", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=0)
    parser.add_argument("--no-eager", action="store_true",
                        help="BF16 too: skip eager, host-function and HF-module comparisons")
    parser.add_argument("--no-alternatives", action="store_true",
                        help="BF16: keep eager decode and launch counts, skip the host-function "
                             "and HF-module comparisons")
    parser.add_argument("--timeout", type=int, default=480, help="seconds per mode")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        path = args.out / f"{args.shape}-{mode}.json"
        cmd = [sys.executable, "-m", "hetmoe.cli", "bench", *mode_args(mode, args, args.out),
               "--json", str(path)]
        print("$", " ".join(cmd[1:]), flush=True)
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, timeout=args.timeout, check=False)
            ok = done.returncode == 0 and path.exists()
            error = "" if ok else f"exit code {done.returncode}"
        except subprocess.TimeoutExpired:
            ok, error = False, f"timed out after {args.timeout} s"
        results[mode] = json.loads(path.read_text()) if ok else {"error": error}
        print(f"# {mode}: {time.perf_counter() - start:.0f} s {error}", flush=True)
    summary = ratios(results)
    (args.out / f"{args.shape}.json").write_text(json.dumps(
        {"shape": args.shape, "ratios": summary, "results": results}, indent=1))
    print(markdown(args.shape, results, summary))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
