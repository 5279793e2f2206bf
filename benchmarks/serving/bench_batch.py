"""Offline batch throughput: a `hetmoe batch` job of N requests on a random-weight real shape.

Writes the job's JSONL (OpenAI Batch lines, completions with random token-id prompts of
`--prompt-len`, `--new-tokens` each), then runs it through the job core of `hetmoe batch`
(engine/requests/batch_job.py: lines read and checked, every request handed to the scheduler at
once, results written as they end) over the hybrid runner (CUDA graphs, CPU experts, batched prefill
and mixed steps). Random weights have no tokenizer, so requests go straight to the scheduler
(token ids in and out, `ignore_eos`) instead of through the API's routes. Per GPU expert budget
(`--budgets`, GiB; the same model, re-placed between jobs), with `--placement-sample N` the
experts that N of the job's prompts route to most are placed first (engine/preplacement.py),
else each layer's first experts. Reports job tok/s (completion tokens / job wall time), all
tokens per second, time to first and last result. `--stream-decode 0,auto` runs the jobs once
per `EngineConfig.stream_decode_rows` setting (0: every decode step on the decode path; auto, the
engine's default: large decode steps may stream experts to the GPU, the decode tuner weighing them
against the decode path), recording the rows from which steps weigh streaming and the k kept
per row bucket (0: the decode path).

    python benchmarks/serving/bench_batch.py --weight-format int8 --budgets 0,15 --json b.json
    python benchmarks/serving/bench_batch.py --weight-format int8 --budgets 0 --prompt-len 64 \
        --new-tokens 64 --stream-decode 0,auto --json stream_decode_batch.json
    python benchmarks/serving/bench_batch.py --model tiny-qwen3-moe --requests 16 --budgets 0

Prints a table; `--json` writes config, git SHA, machine facts and every number.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.harness import git_sha, now_utc
from hetmoe.bench.serving_runner import (
    decode_streaming,
    number_list,
    serving_runner,
    stream_settings,
)
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.preplacement import count_routing, sample_lines
from hetmoe.engine.requests.batch_job import JobFiles, JobLine, read_lines, run_job
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Event, Scheduler
from hetmoe.machine import machine_report

GIB = 2**30


def build_runner(args: argparse.Namespace, window: int) -> ModelRunner:
    """The hybrid runner over a random-weight shape (or a checkpoint's), experts on the CPU."""
    return serving_runner(args, args.max_batch, window,
                          {"gpu_expert_bytes": 0, "prefill_chunk": args.prefill_chunk})


def write_job(path: Path, n: int, prompt_len: int, new_tokens: int, vocab: int,
              seed: int) -> None:
    """N completions lines with random token-id prompts."""
    ids = torch.randint(0, vocab, (n, prompt_len), generator=torch.Generator().manual_seed(seed))
    with path.open("w") as out:
        for i, prompt in enumerate(ids.tolist()):
            body = {"prompt": prompt, "max_tokens": new_tokens}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                  "url": "/v1/completions", "body": body}) + "\n")


async def answer_with(scheduler: Scheduler, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One request through the scheduler (token ids in and out); its response body."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[dict[str, Any]] = loop.create_future()
    tokens: list[int] = []

    def sink(event: Event) -> None:  # on the scheduler thread
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            result = {"choices": [{"token_ids": list(tokens),
                                   "finish_reason": event.finish_reason}],
                      "usage": {"prompt_tokens": len(body["prompt"]),
                                "completion_tokens": len(tokens)}}
            loop.call_soon_threadsafe(done.set_result, result)

    params = SamplingParams(max_new_tokens=int(body["max_tokens"]), temperature=0.0)
    scheduler.submit(body["prompt"], params, sink, ignore_eos=True)
    result = await done
    return (200, result) if result["choices"][0]["finish_reason"] == "length" else (500, result)


def run_one(runner: ModelRunner, source: Path, out: Path) -> dict[str, float]:
    """Runs the job of `source` into `out` (fresh files); its timings."""
    lines = [x for x in read_lines(source) if isinstance(x, JobLine)]
    files = JobFiles(out, out.with_suffix(".errors.jsonl"))
    scheduler = Scheduler(runner, lambda ids: "", eos_token_ids=(), max_queue=len(lines))
    ends: list[float] = []
    tokens = [0]

    def on_result(completion_tokens: int) -> None:
        ends.append(time.perf_counter())
        tokens[0] += completion_tokens

    async def job() -> None:
        await run_job(lines, files, lambda _url, body: answer_with(scheduler, body),
                      on_result, len(lines))

    start = time.perf_counter()
    try:
        asyncio.run(job())
    finally:
        scheduler.stop()
        files.close()
    wall = time.perf_counter() - start
    prompt = sum(len(x.body["prompt"]) for x in lines)
    failed = len(lines) - sum(1 for _ in out.open()) if out.exists() else len(lines)
    if failed:
        raise RuntimeError(f"{failed} of {len(lines)} requests failed (see {files.errors})")
    return {"wall_s": wall, "job_tok_s": tokens[0] / wall, "all_tok_s": (tokens[0] + prompt) / wall,
            "first_result_s": min(ends) - start, "last_result_s": max(ends) - start,
            "completion_tokens": tokens[0], "mean_rows_per_step":
            scheduler.decode_rows / max(scheduler.decode_steps, 1)}


def place(runner: ModelRunner, source: Path, gib: float, sample: int) -> dict[str, Any]:
    """Places `gib` GiB of experts: the most routed by `sample` of the job's prompts, or each
    layer's first ones (sample 0)."""
    started = time.perf_counter()
    counts = None
    if sample and gib:
        lines = [x for x in read_lines(source) if isinstance(x, JobLine)]
        counts = count_routing(runner, [x.body["prompt"] for x in sample_lines(lines, sample)])
    plan = runner.place(int(gib * GIB), counts)
    return {"place_s": time.perf_counter() - started, "gpu_expert_bytes": plan.bytes,
            "sample_share": plan.gpu_share(counts) if counts is not None else None,
            "uniform_share": plan.gpu_share()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="random-weight shape")
    parser.add_argument("--model", default=None, help="a checkpoint or preset instead of --shape")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers")
    parser.add_argument("--weight-format", default="int8", help="bf16, int8 or int4 experts")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=256, help="KV slots (rows decoded "
                        "together at most)")
    parser.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens per step")
    parser.add_argument("--budgets", type=number_list(float, 0), default=[0.0, 15.0],
                        help="GiB of experts on the GPU, one job each")
    parser.add_argument("--placement-sample", type=int, default=32,
                        help="prompts routed to pick the experts placed (0: the first ones)")
    parser.add_argument("--stream-decode", type=stream_settings,
                        default=[EngineConfig.stream_decode_rows],
                        help="EngineConfig.stream_decode_rows per job, e.g. 0,auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    started = time.perf_counter()
    runner = build_runner(args, args.prompt_len + args.new_tokens + 8)
    build_s = time.perf_counter() - started
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "job.jsonl"
        write_job(source, args.requests, args.prompt_len, args.new_tokens, runner.vocab_size,
                  args.seed)
        for setting, gib in ((s, g) for s in args.stream_decode for g in args.budgets):
            runner.config = dataclasses.replace(runner.config, stream_decode_rows=setting)
            placed = place(runner, source, gib, args.placement_sample)  # prepares the rows
            key = f"{gib:g}" if args.stream_decode == [0] else f"{setting}/{gib:g}"
            out = Path(tmp) / f"out_{setting}_{gib:g}.jsonl"
            results[key] = placed | {"stream_decode_rows": setting} | run_one(runner, source, out)
            results[key] |= decode_streaming(runner)
            print(f"{key}: {results[key]}", flush=True)
    rows = [f"{'GiB':>10}{'job tok/s':>11}{'all tok/s':>11}{'wall s':>9}{'first s':>9}"
            f"{'rows/step':>11}{'GPU share':>11}  kept k"]
    for key, r in results.items():
        share = r["sample_share"] if r["sample_share"] is not None else r["uniform_share"]
        rows.append(f"{key:>10}{r['job_tok_s']:>11.1f}{r['all_tok_s']:>11.1f}{r['wall_s']:>9.1f}"
                    f"{r['first_result_s']:>9.1f}{r['mean_rows_per_step']:>11.1f}{share:>11.1%}"
                    f"  {r['decode_ks']}")
    print(f"{args.requests} requests x ({args.prompt_len} prompt, {args.new_tokens} output), "
          f"{args.shape if args.model is None else args.model}, built in {build_s:.0f} s")
    print("\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "config": vars(args) | {"json": str(args.json)},
            "date": now_utc(), "git": git_sha(),
            "machine": machine_report() | {
                "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
            "build_s": round(build_s, 1), "budgets": results}, indent=1))


if __name__ == "__main__":
    main()
