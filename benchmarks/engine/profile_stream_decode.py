"""Where a streamed decode step's time goes, against the graph decode step of the same rows.

Builds a random-weight model of a real shape (routed experts in the CPU backend, every expert on
the CPU), prefills `--rows` sequences in one pass, then profiles (torch.profiler, CPU + CUDA):
- `graph`: the decode path (CUDA graph replay, CPU experts through the ready/done words);
- `stream`: the same rows as one pass on the HF layers with `--k` misses per layer streamed to
  the GPU and the rest on the CPU (what `EngineConfig.stream_decode_rows` runs for k > 0).
Per path, over `--steps` profiled steps (medians per step): the step's wall time, each CUDA
stream's busy time (the copy stream: bytes and GB/s of its host-to-device copies), the compute
stream's idle gaps (total, per MoE layer, the largest), the CUDA runtime calls the host spent
time in (syncs above all), the top GPU kernels; for `stream` also the host's time per layer in
attention (eager launches) and in the MoE layer (its waits for the router and the CPU included),
from module hooks. Unprofiled wall ms per step (`ahead`: graph steps launched one ahead, as
serving runs them) gives the real numbers beside the traced ones.

    python benchmarks/engine/profile_stream_decode.py --weight-format int8 --rows 128 --k 60
        [--num-layers 24] [--steps 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.serving_runner import serving_runner
from hetmoe.bench.shapes import SHAPES
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.step import PrefillChunk, StepPlan

GAP_US = 20.0
"""Compute-stream idle gaps shorter than this are launch spacing, not waits."""


def decode(runner: ModelRunner, slots: tuple[int, ...], tokens: tuple[int, ...], steps: int,
           ahead: bool = False) -> tuple[tuple[int, ...], float]:
    """`steps` greedy decode steps of every row; (last tokens, wall ms per step)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in range(steps):
        out = runner.step(StepPlan(slots, tokens, greedy=True, ahead=ahead and n + 1 < steps))
        assert out.tokens is not None
        tokens = out.tokens
    runner.settle()
    return tokens, (time.perf_counter() - start) * 1e3 / steps


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_summary(path: Path, label: str, layers: int) -> dict[str, Any]:
    """Per-step medians of one path's chrome trace (see the module docstring)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"] == label)
    per_step: list[dict[str, Any]] = []
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for a, b in windows:
        inside = [e for e in events if a <= e["ts"] < b]
        gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        streams: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in gpu:
            streams[int(e.get("args", {}).get("stream", -1))].append(e)
        busy = {s: union_us([(e["ts"], e["ts"] + e["dur"]) for e in es])
                for s, es in streams.items()}
        compute = max(streams, key=lambda s: sum(e["dur"] for e in streams[s]
                                                 if e["cat"] == "kernel"), default=-1)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in streams.get(compute, []))
        gaps = [n[0] - p[1] for p, n in zip(spans, spans[1:], strict=False) if n[0] - p[1] > GAP_US]
        h2d = [e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
        h2d_bytes = sum(float(e.get("args", {}).get("bytes", 0)) for e in h2d)
        h2d_us = union_us([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
        per_step.append({
            "step_ms": (b - a) / 1e3, "compute_busy_ms": busy.get(compute, 0.0) / 1e3,
            "compute_idle_ms": sum(gaps) / 1e3, "gaps": len(gaps),
            "idle_us_per_layer": sum(gaps) / max(1, layers),
            "largest_gaps_us": sorted(gaps, reverse=True)[:5],
            "streams_busy_ms": {str(s): v / 1e3 for s, v in busy.items()},
            "h2d_mb": h2d_bytes / 1e6, "h2d_busy_ms": h2d_us / 1e3,
            "h2d_gb_s": h2d_bytes / max(h2d_us, 1e-9) / 1e3})
        for e in inside:
            table = kernels if e.get("cat") == "kernel" else \
                runtime if e.get("cat") == "cuda_runtime" else None
            if table is not None:
                table[e["name"]][0] += 1 / len(windows)
                table[e["name"]][1] += e["dur"] / len(windows)
    out: dict[str, Any] = {k: statistics.median(s[k] for s in per_step) for k in
                           ("step_ms", "compute_busy_ms", "compute_idle_ms", "gaps",
                            "idle_us_per_layer", "h2d_mb", "h2d_busy_ms", "h2d_gb_s")}
    out["largest_gaps_us"] = per_step[len(per_step) // 2]["largest_gaps_us"]
    out["streams_busy_ms"] = per_step[len(per_step) // 2]["streams_busy_ms"]
    out["kernels"] = [(n[:70], round(c, 1), round(us, 1)) for n, (c, us) in
                      sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]]
    out["runtime"] = [(n, round(c, 1), round(us, 1)) for n, (c, us) in
                      sorted(runtime.items(), key=lambda kv: -kv[1][1])[:8]]
    return out


def host_layer_hooks(runner: ModelRunner) -> tuple[dict[str, list[float]], list[Any]]:
    """Host microseconds per call of every layer's attention and MLP module (module hooks;
    the HF layers of a streamed pass run them, graph replays do not)."""
    spent: dict[str, list[float]] = defaultdict(list)
    handles = []
    for layer in runner.base.layers:
        for name in ("self_attn", "mlp"):
            module, began = getattr(layer, name), [0.0]

            def pre(*_: Any, began: list[float] = began) -> None:
                began[0] = time.perf_counter()

            def post(*_: Any, began: list[float] = began, name: str = name) -> None:
                spent[name].append((time.perf_counter() - began[0]) * 1e6)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return spent, handles


def profiled(runner: ModelRunner, slots: tuple[int, ...], tokens: tuple[int, ...], label: str,
             steps: int, layers: int) -> tuple[tuple[int, ...], dict[str, Any]]:
    """`steps` decode steps under torch.profiler (CPU, and CUDA when there is one), each in a
    `label` range; their summary. The trace is exported after the profiler's block: leaving the
    block stops the profiler, and a second stop raises (torch 2.11: "Can't disable Kineto
    profiler when it's not running")."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=activities) as p:
            for _ in range(steps):
                with torch.profiler.record_function(label):
                    tokens, _ = decode(runner, slots, tokens, 1)
        trace = Path(tmp) / "trace.json"
        p.export_chrome_trace(str(trace))
        return tokens, trace_summary(trace, label, layers)


def print_path(label: str, r: dict[str, Any]) -> None:
    print(f"\n{label}: wall {r['wall_ms']:.1f} ms/step ({r.get('ahead_ms', 0):.1f} launched "
          f"ahead); traced {r['step_ms']:.1f} ms: compute stream busy {r['compute_busy_ms']:.1f}"
          f", idle {r['compute_idle_ms']:.1f} in {r['gaps']:.0f} gaps > {GAP_US:.0f} us "
          f"({r['idle_us_per_layer']:.0f} us per layer; largest {r['largest_gaps_us'][:3]})")
    print(f"  streams busy ms {r['streams_busy_ms']}; H2D {r['h2d_mb']:.0f} MB in "
          f"{r['h2d_busy_ms']:.1f} ms ({r['h2d_gb_s']:.1f} GB/s)")
    if "host_us_per_layer" in r:
        print(f"  host per layer: {r['host_us_per_layer']}")
    print(f"  {'CUDA runtime call':<44} {'calls':>7} {'us':>9}")
    for name, calls, us in r["runtime"]:
        print(f"  {name:<44} {calls:7.1f} {us:9.1f}")
    print(f"  {'GPU kernel':<70} {'calls':>7} {'us':>9}")
    for name, calls, us in r["kernels"]:
        print(f"  {name:<70} {calls:7.1f} {us:9.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--weight-format", default="int8")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--k", type=int, default=60, help="misses per layer streamed")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps per path")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_stream_decode needs a CUDA device", file=sys.stderr)
        return 2
    args.model, args.seed = None, 0
    window = args.prompt_len + 12 * args.steps + 64
    built = time.perf_counter()
    runner = serving_runner(args, args.rows, window, {"gpu_expert_bytes": 0}, "cpu",
                            graph_batch_sizes=(args.rows,))
    planner = runner.planner
    assert planner is not None and runner.overlap is not None
    layers = len(runner.overlap.layers)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "gpu": torch.cuda.get_device_name(), "moe_layers": layers,
                              "build_s": round(time.perf_counter() - built, 1)}
    slots = tuple(runner.cache.allocate() for _ in range(args.rows))
    chunks = tuple(PrefillChunk(s, tuple(range(1 + i, 1 + i + args.prompt_len)))
                   for i, s in enumerate(slots))
    logits = runner.step(StepPlan(prefills=chunks)).prefill_logits
    tokens = tuple(int(row[-1].argmax()) for row in logits)
    # The graph decode path (stream_decode_rows 0): captured, timed, then traced.
    tokens, _ = decode(runner, slots, tokens, 3)
    tokens, wall = decode(runner, slots, tokens, 3)
    tokens, ahead = decode(runner, slots, tokens, 4, ahead=True)
    tokens, graph = profiled(runner, slots, tokens, "graph", args.steps, layers)
    result["graph"] = {"wall_ms": wall, "ahead_ms": ahead, **graph}
    # The same rows as a streamed pass of k misses per layer.
    planner.decode_rows = args.rows
    planner.decode_experts = lambda rows, mode="auto": (args.k, False)  # type: ignore[method-assign]
    if not planner.can_stream():
        print(f"this GPU cannot stream: {planner.stream_refusal}", file=sys.stderr)
        return 2
    tokens, _ = decode(runner, slots, tokens, 2)  # the streamer made, host memory registered
    tokens, wall = decode(runner, slots, tokens, 3)
    spent, handles = host_layer_hooks(runner)
    tokens, stream = profiled(runner, slots, tokens, "stream", args.steps, layers)
    for handle in handles:
        handle.remove()
    stream["host_us_per_layer"] = {n: round(statistics.median(v), 1) for n, v in spent.items()}
    result["stream"] = {"wall_ms": wall, **stream}
    runner.overlap.detach()
    print(f"{args.shape} {args.weight_format}, {layers} MoE layers, {args.rows} rows, k = "
          f"{args.k}, {result['gpu']} (model built in {result['build_s']} s)")
    for label in ("graph", "stream"):
        print_path(label, result[label])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
