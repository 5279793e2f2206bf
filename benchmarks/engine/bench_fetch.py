"""Fetch-or-compute (engine/placement/placement_fetch.py) off and on at a partial GPU expert budget.

One random-weight model; per staging-slot count (0 = off, then each of --fetch-slots) the
runner is re-placed at --budget GB (`ModelRunner.place(fetch_slots=...)`) and timed on:

- prefill: one chunk of each --chunks length on the placement's path (`prefill_experts="cpu"`:
  resident experts on the GPU, misses on the CPU less those fetched), best of --repeats; the
  engine's own choice (`auto`, which may stream or split every layer instead) is timed once
  per chunk length beside it, with no pool, for context;
- batched decode: --batches rows decoded eagerly (a CUDA graph step never fetches: the plan
  needs the ids on the host), median step of --steps after one untimed step.

Each row: seconds, tok/s, experts fetched per layer step and the ratio to slots 0 (same
budget). The JSON also holds this machine's costs and `least_tokens` (fewest tokens on one
expert for which a fetch pays): random weights route spread, so batched decode seldom has a
miss that heavy and fetches nothing there.

    python benchmarks/engine/bench_fetch.py --shape qwen3-30b-a3b --weight-format int8 \\
        --budget 8 --fetch-slots 8,32 --json fetch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.harness import git_sha, machine_facts, now_utc
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.fetch_plan import least_tokens
from hetmoe.engine.placement.placement_fetch import StagingPool

GB = 1e9


def pool_of(runner: ModelRunner) -> StagingPool | None:
    """The runner's staging pool (every layer's link shares it), its counters zeroed."""
    assert runner.overlap is not None
    pool = next((link.pool for link in runner.overlap.placed.values()), None)
    if pool is not None:
        pool.steps = pool.fetched = 0
    return pool


def per_step(pool: StagingPool | None) -> float:
    return round(pool.fetched / pool.steps, 2) if pool is not None and pool.steps else 0.0


def release(runner: ModelRunner) -> None:
    """Gives the runner's resident experts and pool back and detaches its MoE step."""
    runner.place(0, fetch_slots=0)
    assert runner.overlap is not None
    runner.overlap.detach()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def decode_step_s(runner: ModelRunner, batch: int, vocab: int, steps: int
                  ) -> tuple[float, list[int]]:
    """Median seconds of an eager decode step of `batch` rows (16-token prompts) and the
    first step's tokens."""
    g = torch.Generator().manual_seed(batch)
    slots = [runner.cache.allocate() for _ in range(batch)]
    try:
        tokens = [measure.first_token(runner, s, torch.randint(0, vocab, (16,), generator=g)
                                      .tolist()) for s in slots]
        times, first = [], []
        for _ in range(steps + 1):
            measure.sync(runner.device)
            start = time.perf_counter()
            tokens = runner.decode(slots, tokens).argmax(-1).tolist()
            measure.sync(runner.device)
            times.append(time.perf_counter() - start)
            first = first or tokens
        return statistics.median(times[1:]), first
    finally:
        for s in slots:
            runner.free(s)


def prefill_rows(model: Any, args: argparse.Namespace, settings: list[int], budget: int,
                 vocab: int, device: torch.device) -> list[dict[str, Any]]:
    chunks = [int(c) for c in args.chunks.split(",")]
    runner = ModelRunner(model, device, torch.bfloat16, 1, max(chunks) + 8,
                         EngineConfig(gpu_expert_bytes=0, prefill_experts="cpu"))
    rows: list[dict[str, Any]] = []
    try:
        for slots in settings:
            runner.place(budget, fetch_slots=slots)
            for n in chunks:
                pool = pool_of(runner)
                tok_s = measure.prefill_speed(runner, n, vocab, args.repeats)
                rows.append({"mode": "prefill", "tokens": n, "fetch_slots": slots,
                             "seconds": round(n / tok_s, 4), "tok_s": round(tok_s, 1),
                             "fetched_per_layer_step": per_step(pool)})
        runner.place(budget, fetch_slots=0)
        runner.config = dataclasses.replace(runner.config, prefill_experts="auto")
        for n in chunks:
            tok_s = measure.prefill_speed(runner, n, vocab, args.repeats)
            rows.append({"mode": "prefill_auto", "tokens": n, "fetch_slots": 0,
                         "seconds": round(n / tok_s, 4), "tok_s": round(tok_s, 1)})
    finally:
        release(runner)
    return rows


def decode_rows(model: Any, args: argparse.Namespace, settings: list[int], budget: int,
                vocab: int, device: torch.device) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(model, device, torch.bfloat16, max(batches), 16 + args.steps + 8,
                         EngineConfig(gpu_expert_bytes=0))
    runner.use_graphs = False  # fetch-or-compute runs outside graphs only
    rows: list[dict[str, Any]] = []
    first: dict[int, list[int]] = {}
    try:
        for slots in settings:
            runner.place(budget, fetch_slots=slots)
            for b in batches:
                pool = pool_of(runner)
                seconds, tokens = decode_step_s(runner, b, vocab, args.steps)
                first.setdefault(b, tokens)
                rows.append({"mode": "decode_eager", "tokens": b, "fetch_slots": slots,
                             "seconds": round(seconds, 5), "tok_s": round(b / seconds, 1),
                             "fetched_per_layer_step": per_step(pool),
                             "tokens_equal_slots0": tokens == first[b]})
    finally:
        release(runner)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--weight-format", default="int8")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--budget", type=float, default=8.0, help="GB of resident experts")
    p.add_argument("--fetch-slots", default="8,32", help="staging slots per row (0 is added)")
    p.add_argument("--chunks", default="256,1024,4096", help="prefill chunk lengths")
    p.add_argument("--batches", default="1,16,64", help="eager decode batch sizes")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    config = shape_config(args.shape, args.num_layers)
    model = build_random_model(config, device, torch.bfloat16, "cpu", args.weight_format, 0)
    budget = int(args.budget * GB)
    settings = [0] + [int(s) for s in args.fetch_slots.split(",") if int(s)]
    rows = prefill_rows(model, args, settings, budget, config.vocab_size, device)
    rows += decode_rows(model, args, settings, budget, config.vocab_size, device)
    base = {(r["mode"], r["tokens"]): r["seconds"] for r in rows if r["fetch_slots"] == 0}
    for r in rows:
        r["speedup_vs_slots0"] = round(base[r["mode"], r["tokens"]] / r["seconds"], 3)
        print(json.dumps(r), flush=True)
    probe = ModelRunner(model, device, torch.bfloat16, 1, 8, EngineConfig(gpu_expert_bytes=0))
    assert probe.overlap is not None and probe.planner is not None
    costs = probe.planner.load_costs()
    probe.overlap.detach()
    result = {"command": "benchmarks/engine/bench_fetch.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "date": now_utc(), "git": git_sha(), "machine": machine_facts(device),
              "costs": dataclasses.asdict(costs), "least_tokens": least_tokens(costs),
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
