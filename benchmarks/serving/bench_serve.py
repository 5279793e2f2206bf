"""Serving throughput: aggregate tok/s of N concurrent streams through the scheduler, swept.

The server's path without HTTP: the `Scheduler` of `hetmoe serve` over the hybrid runner (CUDA
graphs per batch size, CPU experts) of a random-weight model of a real shape. All N requests
start together (distinct random prompts, greedy, `ignore_eos`, `--new-tokens` each); prompts are
prefilled together under the scheduler's token budget and each step is ONE runner step (prompt
chunks and decode rows in one forward pass), so each MoE layer reads an expert once per step.
One model build; per GPU expert budget (`--budgets`, GiB, in the given order) the runner is
re-placed (`ModelRunner.place`), then every `--streams` count is a point (a warm-up run of
`--warmup-tokens`, then the timed one): aggregate tok/s, decode tok/s once every request has its
first token, ms per step, the time to first token of each request (p50 and max in the table,
every request's in the JSON), and the ratio to the 1-stream point of the same budget (one request
alone, the baseline). `--stream-decode 0,auto` repeats the sweep per
`EngineConfig.stream_decode_rows` setting (0: every decode step on the decode path; auto, the
engine's default: large steps may stream experts to the GPU), so one run compares them; each
point records the rows from which decode steps weigh streaming and, per row bucket the decode
tuner weighed, the k it kept (0: the decode path). The JSON is rewritten after every point, so a
run cut short keeps the finished ones; past `--deadline` seconds from the start no new point begins.
`--wait-for FILE` holds the first point until FILE exists (another program building on this
machine must not share its cores).

    python benchmarks/serving/bench_serve.py --weight-format int8 --budgets 0,15 \
        --streams 1,2,4,8,16,32,64,128,256 --new-tokens 48 --deadline 300 --json serve.json
    python benchmarks/serving/bench_serve.py --json serve.json --peer batched_bench.md \
        --plot serve.png                               # the PNG of an earlier run, no GPU
    python benchmarks/serving/bench_serve.py --weight-format int8 --streams 64,128 \
        --stream-decode 0,auto --warmup-tokens 16 --new-tokens 32 --json stream_decode.json
    python benchmarks/serving/bench_serve.py --model tiny-qwen3-moe --streams 1,4   # CPU smoke run

`--plot`: aggregate tok/s against streams (log2) per budget, beside llama.cpp's
`llama-batched-bench` rows of each `--peer [LABEL=]FILE` (its markdown table or JSONL, as
batch_peer.sh saves it); bench/serve_report.py says which of its columns match ours.
Prints a table; `--json` writes config, git SHA, machine facts and every number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.batched_bench import parse_batched_bench
from hetmoe.bench.harness import git_sha, now_utc
from hetmoe.bench.serve_report import plot, table
from hetmoe.bench.serving_runner import (
    decode_streaming,
    number_list,
    serving_runner,
    stream_settings,
)
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Event, Scheduler
from hetmoe.machine import machine_report

GIB = 2**30


def build_runner(args: argparse.Namespace, max_batch: int, window: int) -> ModelRunner:
    """The hybrid runner over a random-weight shape, or the engine's runner of a checkpoint;
    every routed expert on the CPU until `place`."""
    sizes = tuple(sorted({1, 2, 4, 8, *range(16, max_batch + 1, 8), max_batch}))
    return serving_runner(args, max_batch, window, {"gpu_expert_bytes": 0}, args.experts,
                          graph_batch_sizes=sizes)


def place(runner: ModelRunner, gib: float) -> dict[str, Any]:
    """Re-places the runner's experts under `gib` GiB on the GPU (0: all on the CPU); the
    point's budget facts."""
    plan = runner.place(int(gib * GIB)) if gib or runner.overlap is not None else None
    return {"budget_gib": gib, "gpu_expert_bytes": plan.bytes if plan is not None else 0,
            "gpu_share": round(plan.gpu_share(), 4) if plan is not None else 0.0}


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


def sweep(runner: ModelRunner, args: argparse.Namespace, result: dict[str, Any],
          past_deadline: Callable[[], bool]) -> None:
    """Every (budget, streams) point in order into `result["points"]`, the JSON written after
    each; stops before a point once `past_deadline()` (the reason in `result["stopped"]`)."""
    generator = torch.Generator().manual_seed(args.seed)

    def prompts(n: int) -> list[list[int]]:
        ids = torch.randint(0, runner.vocab_size, (n, args.prompt_len), generator=generator)
        return ids.tolist()

    print(f"{'stream':>7}{'GiB':>6}{'streams':>8}{'tok/s':>10}{'decode tok/s':>14}"
          f"{'ms/step':>10}{'TTFT p50 s':>12}{'TTFT max s':>12}{'x 1 stream':>12}  kept k",
          flush=True)
    for setting in args.stream_decode:
        runner.config = dataclasses.replace(runner.config, stream_decode_rows=setting)
        for gib in args.budgets:
            placed = place(runner, gib) | {"stream_decode_rows": setting}  # prepares the rows
            one: float | None = None  # the 1-stream point's tok/s
            scheduler = Scheduler(runner, lambda ids: "", eos_token_ids=(),
                                  max_queue=max(args.streams))
            try:
                for n in args.streams:
                    if past_deadline():
                        which = f"stream_decode_rows {setting}, " if \
                            len(args.stream_decode) > 1 else ""
                        result["stopped"] = (f"--deadline {args.deadline:g} s: before "
                                             f"{which}{gib:g} GiB, {n} streams")
                        return
                    # CUDA graphs, allocator, CPU pool; the decode tuner's weighed steps
                    serve_together(scheduler, prompts(n), args.warmup_tokens)
                    run = serve_together(scheduler, prompts(n), args.new_tokens)
                    one = run["tok_s"] if n == 1 else one
                    ratio = run["tok_s"] / one if one else None
                    streaming = decode_streaming(runner)
                    result["points"].append(placed | {"streams": n} | _rounded(run) | {
                        "x_one_stream": None if ratio is None else round(ratio, 3)} | streaming)
                    write(result, args.json)
                    print(f"{setting!s:>7}{gib:>6g}{n:>8}{run['tok_s']:>10.2f}"
                          f"{run['decode_tok_s']:>14.2f}{run['ms_per_step']:>10.2f}"
                          f"{run['ttft_p50_s']:>12.3f}{run['ttft_s']:>12.3f}"
                          f"{'' if ratio is None else f'{ratio:.2f}':>12}  "
                          f"{streaming['decode_ks']}", flush=True)
            finally:
                scheduler.stop()


def wait_for(path: Path, past_deadline: Callable[[], bool]) -> bool:
    """Waits until `path` exists; False when the deadline came first."""
    while not path.exists():
        if past_deadline():
            return False
        time.sleep(0.2)
    return True


def write(result: dict[str, Any], path: Path | None) -> None:
    """The result so far (a run cut short keeps its points)."""
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", help="random-weight shape")
    parser.add_argument("--model", default=None, help="a checkpoint or preset instead of --shape")
    parser.add_argument("--num-layers", type=int, default=None, help="fewer decoder layers")
    parser.add_argument("--experts", default="cpu", help="cpu (ours) or torch-cpu")
    parser.add_argument("--weight-format", default="bf16", help="bf16, int8 or int4 experts")
    parser.add_argument("--streams", type=number_list(int, 1), default=[1, 4, 16],
                        help="concurrent streams per point, e.g. 1,2,4,...,256")
    parser.add_argument("--budgets", type=number_list(float, 0), default=[0.0],
                        help="GiB of routed experts on the GPU per sweep, e.g. 0,15")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stream-decode", type=stream_settings,
                        default=[EngineConfig.stream_decode_rows],
                        help="EngineConfig.stream_decode_rows per sweep, e.g. 0,auto")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="new tokens of each point's warm-up run (auto: the decode tuner "
                             "weighs its first steps of a row bucket there)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds from the start after which no new point begins")
    parser.add_argument("--wait-for", type=Path, default=None, metavar="FILE",
                        help="hold the first point until FILE exists (at most to --deadline)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the results here (with --plot: read them)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="draw the PNG of the --json of an earlier run (no GPU needed)")
    parser.add_argument("--peer", action="append", default=[], metavar="[LABEL=]FILE",
                        help="with --plot: llama-batched-bench's output to draw beside ours")
    args = parser.parse_args(argv)
    if args.plot is not None and args.json is None:
        parser.error("--plot draws the results of --json FILE, and none was given")
    return args


def draw(args: argparse.Namespace) -> None:
    """`--plot`: the PNG (and its series as text) from --json and each --peer."""
    peers = {}
    for spec in args.peer:
        label, _, name = spec.rpartition("=")
        peers[label or "llama.cpp"] = parse_batched_bench(Path(name).read_text(), name)
    drawn = plot(json.loads(args.json.read_text()), peers, str(args.plot))
    print(table(drawn))


def main(argv: list[str] | None = None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.plot is not None:
        draw(args)
        return

    def past_deadline() -> bool:
        return args.deadline is not None and time.perf_counter() - started > args.deadline

    runner = build_runner(args, max(args.streams), args.prompt_len + args.new_tokens + 8)
    build_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": now_utc(),
        "git": git_sha(),
        "machine": machine_report() | {
            "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None
        },
        "runner": type(runner).__name__,
        "build_s": round(build_s, 1),
        "points": [],
        "stopped": None,
    }
    waited = time.perf_counter()
    if args.wait_for is not None and not wait_for(args.wait_for, past_deadline):
        result["stopped"] = f"--deadline {args.deadline:g} s: {args.wait_for} never came"
    result["waited_s"] = round(time.perf_counter() - waited, 1)
    write(result, args.json)
    if result["stopped"] is None:
        sweep(runner, args, result, past_deadline)
    write(result, args.json)
    if result["stopped"] is not None:
        print(f"stopped: {result['stopped']}")


def _rounded(run: dict[str, Any]) -> dict[str, Any]:
    """A run's numbers to 5 significant digits (per-request lists too): 4 decimals would cut a
    fast run's few-millisecond wall time by percents."""
    def sig(x: float) -> float:
        return float(f"{x:.5g}")
    return {k: [sig(x) for x in v] if isinstance(v, list) else sig(v) for k, v in run.items()}


if __name__ == "__main__":
    main()
