"""Where a graph decode step's time goes on the CPU side, against the same layers called alone.

Builds a random-weight model of a real shape (routed experts in the CPU backend), decodes with
the CUDA graph step and every layer's CPU job profiled (`_cpu_testing.take_timeline`: when the job
saw its ready word, was made, ran each phase and set its done word), then calls the same layers
one after another from Python (`CpuMoE.forward`, K random distinct experts, no GPU) with the same
profiling. Per decode step (median over steps), in milliseconds:

- step: wall time of the step; busy: the CPU jobs from ready seen to done set; idle: the rest
  (GPU work the CPU waits for, and the hand-off both ways);
- build: what of the job is made after the ready word (decode: routing and token conversion);
- start: job made -> its first task started (the pool's barrier);
- gate/up, down: first task start -> last task end of each phase (decode runs both in one
  phase: down counts from the later of its first task start and gate/up's last task end); between:
  the rest of the phases (barriers, the combine phase);
- finish: last task end -> done word set;
- head: step start -> the first job's ready word seen; tail: the last done word -> step end;
- the idle between two jobs, split: dispatch (the previous done word -> the job's build step,
  which first waits for its prepare step if still running) and ready_wait (spinning for the
  ready word); make: the prepare step (the decode job made before its ready word), make_late:
  the part of it after the previous done word.
The "alone" row gives the same stages for the standalone calls (start = submit()).

    python benchmarks/engine/profile_step.py --shape qwen3-30b-a3b [--weight-format bf16]
        [--deferred 0,3] [--steps 64] [--num-layers N] [--json FILE] [--gpu-activity]

--gpu-activity adds what the GPU itself runs per step (kernels and copies, torch.profiler).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe import _cpu, _cpu_testing
from hetmoe.bench import measure
from hetmoe.bench.gpu_profile import decode_kernels
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import add_shape_arguments, shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.machine import huge_page_bytes

# Columns of a take_timeline row: start, built, done, (first, last) per phase slot, then picked
# and made (a flagged job's first part).
START, BUILT, DONE = 0, 1, 2
GATE_UP, DOWN = 3 + 2 * 2, 3 + 2 * 3  # slots: convert, gather, gate/up, down, combine
PHASES_END = 3 + 2 * 5
PICKED, MADE, CLAIMED = PHASES_END, PHASES_END + 1, PHASES_END + 2
STAGES = ("build", "start", "gate_up", "between", "down", "finish")
GAPS = ("dispatch", "ready_wait", "make", "make_late")
"""Between a job's previous done word and its ready word seen: dispatch (the pool gets to the
job's build step, waiting for its prepare step if that still runs) and ready_wait (spinning for
the ready word). make: its prepare step (made before the ready word); make_late: the part of it
after the previous job's done word (the rest ran while earlier jobs did)."""


def stages(row: list[int]) -> dict[str, float]:
    """Nanoseconds of each stage of one profiled call (see the module doc)."""
    firsts = [row[i] for i in range(3, PHASES_END, 2) if row[i]]
    lasts = [row[i + 1] for i in range(3, PHASES_END, 2) if row[i]]
    first, last = (min(firsts), max(lasts)) if firsts else (row[BUILT], row[BUILT])
    gu = row[GATE_UP + 1] - row[GATE_UP] if row[GATE_UP] else 0
    # Decode runs gate/up and down in one phase: down counts from gate/up's last task end.
    dn = row[DOWN + 1] - max(row[DOWN], row[GATE_UP + 1]) if row[DOWN] else 0
    return {"build": row[BUILT] - row[START], "start": first - row[BUILT], "gate_up": gu,
            "down": dn, "between": (last - first) - gu - dn, "finish": row[DONE] - last,
            "busy": row[DONE] - row[START]}


def summarize(steps: list[list[list[int]]], step_s: list[float] | None,
              bounds: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Per-step sums of the stages (median over steps, ms), from each step's profiled calls.
    With the steps' `bounds` (monotonic ns): head = step start -> first ready word seen, tail =
    last done word set -> step end (the Python and GPU work around the layers)."""
    sums: dict[str, list[float]] = {k: [] for k in (*STAGES, "busy", *GAPS)}
    if bounds:
        sums["head"], sums["tail"] = [], []
    for s, calls in enumerate(steps):
        per = [stages(row) for row in calls]
        for key in STAGES + ("busy",):
            sums[key].append(sum(p[key] for p in per) / 1e6)
        gaps = dict.fromkeys(GAPS, 0)
        ordered = sorted(calls)
        for before, row in itertools.pairwise(ordered):
            if row[CLAIMED] and row[CLAIMED] >= before[DONE]:
                gaps["dispatch"] += row[CLAIMED] - before[DONE]
                gaps["ready_wait"] += row[START] - row[CLAIMED]
                gaps["make"] += row[MADE] - row[PICKED]
                gaps["make_late"] += max(0, row[MADE] - max(row[PICKED], before[DONE]))
        for key, ns in gaps.items():
            sums[key].append(ns / 1e6)
        if bounds and calls:
            sums["head"].append((min(r[START] for r in calls) - bounds[s][0]) / 1e6)
            sums["tail"].append((bounds[s][1] - max(r[DONE] for r in calls)) / 1e6)
    out = {key: round(statistics.median(v), 3) for key, v in sums.items()}
    out["calls_per_step"] = len(steps[0]) if steps else 0
    if step_s:
        out["step"] = round(statistics.median(step_s) * 1e3, 3)
        out["idle"] = round(out["step"] - out["busy"], 3)
    return out


class HostMarks:
    """Monotonic ns at which each step's host side launched the replay, queued the CPU jobs and
    waited them (wrappers around the runner's calls, removed by `close`)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.marks: dict[str, list[int]] = {}
        self.undo: list[Any] = []
        self.wrap(torch.cuda.CUDAGraph, "replay", "replay")
        self.wrap(runner.overlap, "submit_recorded", "submit")
        self.wrap(runner.overlap, "finish_step", "finish")

    def wrap(self, owner: Any, name: str, mark: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.marks.setdefault(f"{mark}_start", []).append(time.monotonic_ns())
            try:
                return inner(*args, **kwargs)
            finally:
                self.marks.setdefault(f"{mark}_end", []).append(time.monotonic_ns())

        had = name in vars(owner)
        setattr(owner, name, timed)
        self.undo.append(lambda: setattr(owner, name, inner) if had else delattr(owner, name))

    def close(self) -> None:
        for undo in self.undo:
            undo()


def profiled_decode(runner: ModelRunner, layers: list[Any], prompt: list[int],
                    steps: int) -> dict[str, Any]:
    """Graph decode steps with every layer's job profiled; the stage summary, and the host
    side's marks (ms after the step's start, median) against the first ready / last done word."""
    slot = runner.cache.allocate()
    try:
        token = int(runner.prefill(slot, prompt).argmax())
        for _ in range(4):  # capture and warm-up
            token = int(runner.decode([slot], [token])[0].argmax())
        for layer in layers:
            _cpu_testing.set_profile(layer, True)
            _cpu_testing.take_timeline(layer)
        marks = HostMarks(runner)
        step_s, bounds = [], []
        try:
            for _ in range(steps):
                start_ns = time.monotonic_ns()
                start = time.perf_counter()
                token = int(runner.decode([slot], [token])[0].argmax())
                step_s.append(time.perf_counter() - start)
                bounds.append((start_ns, time.monotonic_ns()))
        finally:
            marks.close()
    finally:
        for layer in layers:
            _cpu_testing.set_profile(layer, False)
        runner.cache.free(slot)
    rows = sorted(row for layer in layers for row in _cpu_testing.take_timeline(layer))
    per_step = [[r for r in rows if lo <= r[START] <= hi] for lo, hi in bounds]
    out = summarize(per_step, step_s, bounds)
    starts = [lo for lo, _ in bounds]
    host = {}
    for name, v in marks.marks.items():
        per = len(v) // steps  # e.g. one replay per graph part
        v = v[0::per] if name.endswith("_start") else v[per - 1::per]  # first start, last end
        host[name] = [t - lo for t, lo in zip(v, starts, strict=True)]
    host["first_ready"] = [min(r[START] for r in c) - lo
                           for c, lo in zip(per_step, starts, strict=True)]
    host["last_done"] = [max(r[DONE] for r in c) - lo
                         for c, lo in zip(per_step, starts, strict=True)]
    host["end"] = [hi - lo for lo, hi in bounds]
    out["host_ms"] = {name: round(statistics.median(v) / 1e6, 3)
                      for name, v in sorted(host.items(), key=lambda kv: statistics.median(kv[1]))}
    return out


def gpu_activity(runner: ModelRunner, prompt: list[int], steps: int) -> dict[str, Any]:
    """What the GPU itself runs per graph decode step (torch.profiler's CUDA activities: kernels
    and copies, not the waits on done words): busy ms per step and the largest items."""
    profile = decode_kernels(runner, prompt, steps, warmup=4)
    return {"gpu_busy_ms": round(profile.busy_us / 1e3, 3),
            "items": [{"name": r.name[:90], "us_per_step": round(r.us, 1), "per_step": r.calls}
                      for r in profile.rows[:14]]}


def alone(moes: list[Any], top_k: int, repeats: int) -> dict[str, Any]:
    """The same layers called one after another from Python, profiled the same way."""
    g = torch.Generator().manual_seed(1)
    for moe in moes:
        _cpu_testing.set_profile(moe._layer, True)
        _cpu_testing.take_timeline(moe._layer)
    step_s = []
    for r in range(repeats + 2):
        step_s.append(measure.cpu_experts_pass_s([(moe, top_k) for moe in moes], g,
                                                 torch.bfloat16))
        if r < 2:
            for moe in moes:
                _cpu_testing.take_timeline(moe._layer)
    per_step: list[list[list[int]]] = [[] for _ in range(repeats)]
    for moe in moes:
        for i, row in enumerate(_cpu_testing.take_timeline(moe._layer)):
            per_step[i].append(row)
        _cpu_testing.set_profile(moe._layer, False)
    return summarize(per_step, step_s[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gpu-activity", action="store_true",
                        help="also profile the GPU's own kernels and copies per step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA device", file=sys.stderr)
        return 2
    config = shape_config(args.shape, args.num_layers)
    model = build_random_model(config, torch.device("cuda"), torch.bfloat16, "cpu",
                               args.weight_format, 0)
    runner = ModelRunner(model, torch.device("cuda"), torch.bfloat16, 1, 64 + args.steps,
                         EngineConfig(gpu_expert_bytes=0))  # every expert on the CPU
    moes = [cpu_moe_of(m.experts) for m in runner.overlap.layers]
    packed = sum(m.packed_bytes for m in moes)
    result: dict[str, Any] = {
        "shape": args.shape, "weight_format": args.weight_format,
        "gpu": torch.cuda.get_device_name(), "packed_gb": round(packed / 1e9, 2),
        "huge_page_share": round(min(1.0, huge_page_bytes() / packed), 3),
        "pool_read_gb_s": round(_cpu.read_bandwidth(4 << 30, 5) / 1e9, 1)}
    top_k = config.num_experts_per_tok
    expert_bytes = packed / len(moes) / moes[0].num_experts
    result["bytes_per_step_gb"] = round(expert_bytes * top_k * len(moes) / 1e9, 3)
    result["alone"] = alone(moes, top_k, 10)
    prompt = list(range(1, 33))
    for d in [int(v) for v in args.deferred.split(",") if v]:
        runner.reset_graphs(d)
        result[f"graph_d{d}"] = profiled_decode(runner, [m._layer for m in moes], prompt,
                                                args.steps)
        if args.gpu_activity:
            result[f"graph_d{d}"]["gpu"] = gpu_activity(runner, prompt, 8)
    result["alone_again"] = alone(moes, top_k, 10)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{args.shape} {args.weight_format}: {result['packed_gb']} GB packed, "
          f"{100 * result['huge_page_share']:.0f} % on huge pages, pool read "
          f"{result['pool_read_gb_s']} GB/s, {result['bytes_per_step_gb']} GB of experts/step")
    cols = ("step", "busy", "idle", "head", "tail", *STAGES, *GAPS)
    print(f"{'ms per step':<14}" + "".join(f"{c:>9}" for c in cols) + f"{'GB/s':>8}")
    for name in ("alone", *(k for k in result if k.startswith("graph_d")), "alone_again"):
        r = result[name]
        stream = r["gate_up"] + r["down"]
        rate = result["bytes_per_step_gb"] / stream * 1e3 if stream else 0.0
        print(f"{name:<14}" + "".join(f"{r.get(c, float('nan')):>9.3f}" for c in cols)
              + f"{rate:>8.1f}")
    for name in (k for k in result if k.startswith("graph_d")):
        print(f"{name} host side (ms after the step's start): "
              + ", ".join(f"{k} {v}" for k, v in result[name]["host_ms"].items()))
        gpu = result[name].get("gpu")
        if gpu:
            print(f"{name} GPU busy {gpu['gpu_busy_ms']} ms per step; per step:")
            for item in gpu["items"]:
                print(f"  {item['us_per_step']:>9.1f} us {item['per_step']:>6.1f}x  "
                      f"{item['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
