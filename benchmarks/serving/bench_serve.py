"""Serving throughput: aggregate decode tok/s of N concurrent streams through the scheduler.

The server's path without HTTP: the `Scheduler` of `hetmoe serve` over the hybrid runner (CUDA
graphs per batch size, CPU experts) of a random-weight model of a real shape. All N requests
start together (distinct random prompts, greedy, `ignore_eos`, `--new-tokens` each); prompts are
prefilled together under the scheduler's token budget and each step is ONE runner step (prompt
chunks and decode rows in one forward pass), so each MoE layer reads an expert once per step.
Reported per concurrency: aggregate tok/s, decode tok/s once every request has its first token,
ms per step, and the time to first token of each request (p50 and max in the table, every
request's in the JSON). `--gpu-expert-gib` keeps that many GiB of experts on the GPU.
The baseline, measured in the same run, is the same requests served one after another.

    python benchmarks/serving/bench_serve.py --shape qwen3-30b-a3b --streams 1,4,16 --json out.json
    python benchmarks/serving/bench_serve.py --weight-format int8 --streams 1,4,16,32 \
        --new-tokens 48 --gpu-expert-gib 15 --json serve_15g.json
    python benchmarks/serving/bench_serve.py --model tiny-qwen3-moe --streams 1,4   # CPU smoke run

Prints a table; `--json` writes config, git SHA, machine facts and every number.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.harness import git_sha, now_utc
from hetmoe.bench.serving_runner import serving_runner
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Event, Scheduler
from hetmoe.machine import machine_report


def build_runner(args: argparse.Namespace, max_batch: int, window: int) -> ModelRunner:
    """The hybrid runner over a random-weight shape, or the engine's runner of a checkpoint."""
    budget = int(args.gpu_expert_gib * 2**30)  # 0: every routed expert on the CPU
    sizes = tuple(sorted({1, 2, 4, 8, *range(16, max_batch + 1, 8), max_batch}))
    return serving_runner(args, max_batch, window, {"gpu_expert_bytes": budget}, args.experts,
                          graph_batch_sizes=sizes)


def serve_together(scheduler: Scheduler, prompts: list[list[int]], new_tokens: int
                   ) -> dict[str, Any]:
    """Submits all prompts at once; times until every stream has its `new_tokens` tokens, and
    each request's time to first token."""
    done = threading.Event()
    finished: list[float] = []
    first: dict[int, float] = {}  # request -> its first token's time
    tokens: list[float] = []  # every token's time
    failures: list[str] = []
    steps_at: list[int] = []  # decode steps counted when the last first token came
    lock = threading.Lock()

    def sink_of(i: int) -> Any:
        def sink(event: Event) -> None:  # on the scheduler thread
            now = time.perf_counter()
            with lock:
                if event.token_ids:
                    tokens.extend([now] * len(event.token_ids))
                    if i not in first:
                        first[i] = now
                        if len(first) == len(prompts):
                            steps_at.append(scheduler.decode_steps)
                if event.finish_reason is not None:
                    if event.finish_reason != "length":
                        failures.append(f"{event.finish_reason}: {event.error}")
                    finished.append(now)
                    if len(finished) == len(prompts):
                        done.set()
        return sink

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        scheduler.submit(prompt, params, sink_of(i), ignore_eos=True)
    if not done.wait(timeout=600):
        raise RuntimeError("the streams did not finish within 600 s")
    if failures:
        raise RuntimeError(f"{len(failures)} streams failed, first: {failures[0]}")
    end = max(finished)
    # Decode rate once every request has its first token (batched prefill may let the first
    # requests decode while the last ones prefill, in the same steps).
    decode_from = max(first.values())
    steps = scheduler.decode_steps - steps_at[0]
    later = sum(1 for t in tokens if t > decode_from)
    ttft = sorted(t - start for t in first.values())
    return {
        "wall_s": end - start,
        "tok_s": len(prompts) * new_tokens / (end - start),
        "decode_tok_s": later / (end - decode_from) if end > decode_from else 0.0,
        "ms_per_step": 1e3 * (end - decode_from) / max(steps, 1),
        "ttft_s": ttft[-1],
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_per_request_s": [first[i] - start for i in range(len(prompts))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="random-weight shape")
    parser.add_argument("--model", default=None, help="a checkpoint or preset instead of --shape")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers")
    parser.add_argument("--experts", default="cpu", help="cpu (ours) or torch-cpu")
    parser.add_argument("--weight-format", default="bf16", help="bf16, int8 or int4 experts")
    parser.add_argument("--streams", default="1,4,16", help="concurrent streams to time")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-expert-gib", type=float, default=0.0,
                        help="GiB of routed experts resident on the GPU (0: all on the CPU)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    window = args.prompt_len + args.new_tokens + 8

    started = time.perf_counter()
    runner = build_runner(args, max(streams), window)
    build_s = time.perf_counter() - started
    scheduler = Scheduler(runner, lambda ids: "", eos_token_ids=(), max_queue=max(streams))
    generator = torch.Generator().manual_seed(args.seed)

    def prompts(n: int) -> list[list[int]]:
        ids = torch.randint(0, runner.vocab_size, (n, args.prompt_len), generator=generator)
        return ids.tolist()

    try:
        for n in streams:  # warm-up: CUDA graphs of each batch size, allocator, CPU pool
            serve_together(scheduler, prompts(n), 4)
        together = {n: serve_together(scheduler, prompts(n), args.new_tokens) for n in streams}
        base_n = 4 if 4 in streams else max(streams)
        sequential = [serve_together(scheduler, prompts(1), args.new_tokens)
                      for _ in range(base_n)]
    finally:
        scheduler.stop()
    seq_tok_s = base_n * args.new_tokens / sum(r["wall_s"] for r in sequential)

    rows = [f"{'streams':>8}{'tok/s':>10}{'decode tok/s':>14}{'ms/step':>10}"
            f"{'TTFT p50 s':>12}{'TTFT max s':>12}"]
    for n, r in together.items():
        rows.append(f"{n:>8}{r['tok_s']:>10.2f}{r['decode_tok_s']:>14.2f}"
                    f"{r['ms_per_step']:>10.2f}{r['ttft_p50_s']:>12.3f}{r['ttft_s']:>12.3f}")
    speedup = together[base_n]["tok_s"] / seq_tok_s
    rows.append(f"{base_n} requests one after another: {seq_tok_s:.2f} tok/s; "
                f"{base_n} streams together: {speedup:.2f}x that")
    print("\n".join(rows))
    if args.json is not None:
        result: dict[str, Any] = {
            "config": vars(args) | {"json": str(args.json)},
            "date": now_utc(),
            "git": git_sha(),
            "machine": machine_report() | {
                "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None
            },
            "runner": type(runner).__name__,
            "build_s": round(build_s, 1),
            "together": {str(n): _rounded(r) for n, r in together.items()},
            "sequential": {"requests": base_n, "tok_s": round(seq_tok_s, 4),
                           "runs": [_rounded(r) for r in sequential]},
            "speedup_vs_sequential": round(speedup, 3),
        }
        args.json.write_text(json.dumps(result, indent=1))


def _rounded(run: dict[str, Any]) -> dict[str, Any]:
    """A run's numbers to 4 decimals (per-request lists too)."""
    return {k: [round(x, 4) for x in v] if isinstance(v, list) else round(v, 4)
            for k, v in run.items()}


if __name__ == "__main__":
    main()
