"""Greedy decode of two engine trees side by side: run once per tree, alternating, in one session.

Builds the random-weight model of a shape, then for each repetition and each `deferred` value
times greedy decode as requests run it (steps launched ahead, `measure.greedy_decode`, median
step) and plain steps (`runner.decode`, each step read before the next is launched), with the
pool's read bandwidth just before and after. Runs with the engine of this tree or of a tree from
before the one-runner change (`HybridRunner`), so both can be built and compared in one device
session:

    PYTHONPATH=<build of tree A> python benchmarks/engine/decode_ab.py --json a1.json
    PYTHONPATH=<build of tree B> python benchmarks/engine/decode_ab.py --json b1.json
    # then A and B again

With `--prefill 512,4096` it then times `runner.prefill` of each length (random tokens into a
fresh slot) per `--prefill-modes` value of `EngineConfig.prefill_experts`: the median of
`--prefill-passes` passes after one untimed (auto: after the tuner's turns). ab_trees.sh builds
the trees and runs this alternating in one call; hetmoe.bench.tree_ab tabulates the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hetmoe
from hetmoe import _cpu
from hetmoe.bench import measure
from hetmoe.bench.budget_peer import budget_bytes, parse_budgets
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import add_shape_arguments, shape_config


def engine_module(room: str, name: str) -> Any:
    """`hetmoe.engine.<room>.<name>`, or `hetmoe.engine.<name>` in a tree from before engine/ was
    split into rooms (issue 29): the script is this checkout's, the tree may be older."""
    try:
        return importlib.import_module(f"hetmoe.engine.{room}.{name}")
    except ModuleNotFoundError as e:
        if e.name not in (f"hetmoe.engine.{room}", f"hetmoe.engine.{room}.{name}"):
            raise
        return importlib.import_module(f"hetmoe.engine.{name}")


def make_runner(model: Any, device: torch.device, window: int) -> tuple[str, Any]:
    """This tree's runner (engine/executor/runner.py), or the pre-change tree's `HybridRunner`."""
    try:
        from hetmoe.engine.cuda_graph import HybridConfig, HybridRunner  # type: ignore
    except ImportError:
        from hetmoe.config import EngineConfig

        runner = engine_module("executor", "runner")
        return "this", runner.ModelRunner(model, device, torch.bfloat16, 1, window,
                                          EngineConfig(gpu_expert_bytes=0))
    return "pre-change", HybridRunner(model, device, torch.bfloat16, 1, window, HybridConfig())


def plain_tok_s(runner: Any, prompt: list[int], steps: int) -> float:
    """Decode tokens per second of steps each read before the next (median step)."""
    slot = runner.cache.allocate()
    try:
        token = int(runner.prefill(slot, prompt).argmax())
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = int(runner.decode([slot], [token])[0].argmax())
            times.append(time.perf_counter() - start)
    finally:
        runner.cache.free(slot)
    return 1.0 / statistics.median(times[2:])


def decode_row(runner: Any, prompt: list[int], new_tokens: int, deferred: int,
               budget: str) -> dict[str, Any]:
    """One greedy and one plain decode timing at `deferred`, with the host's read bandwidth
    around the greedy run (its noise is decode's, at budgets that leave experts on the host)."""
    runner.reset_graphs(deferred)
    before = _cpu.read_bandwidth(4 << 30, 5) / 1e9
    run = measure.greedy_decode(runner, prompt, new_tokens)
    after = _cpu.read_bandwidth(4 << 30, 5) / 1e9
    return {"budget": budget, "deferred": deferred, "greedy_tok_s": round(run.tok_s, 2),
            "plain_tok_s": round(plain_tok_s(runner, prompt, 40), 2),
            "read_gb_s_around": [round(before, 1), round(after, 1)]}


def prefill_s(runner: Any, ids: list[int]) -> float:
    """Seconds of one prefill of `ids` into a fresh slot (to its last logits on the host)."""
    slot = runner.cache.allocate()
    try:
        measure.sync(runner.device)
        start = time.perf_counter()
        int(runner.prefill(slot, ids).argmax())
        return time.perf_counter() - start
    finally:
        runner.free(slot)


def prefill_rows(runner: Any, lengths: list[int], modes: list[str], passes: int,
                 cpu_max: int) -> list[dict[str, Any]]:
    """Per prompt length and `prefill_experts` mode: the median of `passes` timed prefills
    after one untimed (auto: after the tuner's turns, so it has settled); "cpu"
    only up to `cpu_max` tokens."""
    # Here, not at the top: trees from before the prefill tuner (decode-only runs) lack it.
    split = engine_module("placement", "expert_split")
    turns = getattr(split, "EXPLORE_PASSES", 2 * split.TRIES)  # trees before the neighbours

    base, rows = runner.config, []
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        ids = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        for mode in modes:
            if mode == "cpu" and n > cpu_max:
                continue
            runner.config = dataclasses.replace(base, prefill_experts=mode)
            try:
                warm = turns if mode == "auto" else 1
                times = [prefill_s(runner, ids) for _ in range(warm + passes)][warm:]
            finally:
                runner.config = base
            median = statistics.median(times)
            planner = runner.planner
            row = {"tokens": n, "mode": mode, "tok_s": round(n / median, 1),
                   "median_s": round(median, 4), "passes_s": [round(t, 4) for t in times],
                   "gpu_experts": planner.gpu_experts(n, mode) if planner else 0}
            rows.append(row)
            print("prefill", row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window", type=int, default=512,
                        help="KV cache length per sequence (at least the longest prefill + 64)")
    parser.add_argument("--prefill", default="", help="prompt lengths to time prefill at "
                        "(comma-separated; empty: decode only)")
    parser.add_argument("--prefill-modes", default="gpu,cpu,auto",
                        help="EngineConfig.prefill_experts values timed at each length")
    parser.add_argument("--prefill-passes", type=int, default=5)
    parser.add_argument("--cpu-max", type=int, default=512,
                        help="longest prompt timed with prefill_experts=cpu")
    parser.add_argument("--budgets", default="0",
                        help="GPU expert budgets in GB (or `all`) the decode rows run at, "
                        "placed in turn (runner.place); `all` times the GPU side alone, free of "
                        "the host's bandwidth noise")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_ab needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    lengths = [int(v) for v in args.prefill.split(",") if v]
    modes = [v for v in args.prefill_modes.split(",") if v]
    window = max([args.window, *(n + 64 for n in lengths)])
    model = build_random_model(shape_config(args.shape, args.num_layers), device,
                               torch.bfloat16, "cpu", args.weight_format, 0)
    tree, runner = make_runner(model, device, window)
    prompt = list(range(1, 33))
    budgets = parse_budgets(args.budgets)
    if tree == "pre-change" and budgets != ["0"]:
        print("decode_ab: the pre-change runner has no GPU experts: --budgets 0 only",
              file=sys.stderr)
        return 2
    runs, placed = [], 0  # placed: the runner's budget in bytes (it starts with none)
    for budget in budgets:
        limit = budget_bytes(budget)
        limit = 10**15 if limit is None else limit  # all: more than there is
        if limit != placed:  # never on the pre-change runner (budget 0 alone)
            runner.place(limit)
            placed = limit
        for _ in range(args.repeats):
            for d in [int(v) for v in args.deferred.split(",") if v]:
                runs.append(decode_row(runner, prompt, args.new_tokens, d, budget))
                print(tree, runs[-1], flush=True)
    if placed:
        runner.place(0)  # prefill rows as before: every expert on the host
    prefill = prefill_rows(runner, lengths, modes, args.prefill_passes, args.cpu_max)
    args.json.write_text(json.dumps({"tree": tree, "hetmoe": str(Path(hetmoe.__file__).parent),
                                     "shape": args.shape, "weight_format": args.weight_format,
                                     "layers": model.config.num_hidden_layers,
                                     "window": window, "runs": runs, "prefill": prefill},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
