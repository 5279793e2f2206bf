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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe import _cpu
from hetmoe.bench import measure
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import add_shape_arguments, shape_config


def make_runner(model: Any, device: torch.device, window: int) -> tuple[str, Any]:
    """This tree's runner (engine/runner.py), or the pre-change tree's `HybridRunner`."""
    try:
        from hetmoe.engine.cuda_graph import HybridConfig, HybridRunner  # type: ignore
    except ImportError:
        from hetmoe.config import EngineConfig
        from hetmoe.engine.runner import ModelRunner

        return "this", ModelRunner(model, device, torch.bfloat16, 1, window,
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window", type=int, default=512, help="KV cache length per sequence")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_ab needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model = build_random_model(shape_config(args.shape, args.num_layers), device,
                               torch.bfloat16, "cpu", args.weight_format, 0)
    tree, runner = make_runner(model, device, args.window)
    prompt = list(range(1, 33))
    runs = []
    for _ in range(args.repeats):
        for d in [int(v) for v in args.deferred.split(",") if v]:
            runner.reset_graphs(d)
            before = _cpu.read_bandwidth(4 << 30, 5) / 1e9
            run = measure.greedy_decode(runner, prompt, args.new_tokens)
            after = _cpu.read_bandwidth(4 << 30, 5) / 1e9
            row = {"deferred": d, "greedy_tok_s": round(run.tok_s, 2),
                   "plain_tok_s": round(plain_tok_s(runner, prompt, 40), 2),
                   "read_gb_s_around": [round(before, 1), round(after, 1)]}
            runs.append(row)
            print(tree, row, flush=True)
    args.json.write_text(json.dumps({"tree": tree, "shape": args.shape,
                                     "weight_format": args.weight_format, "runs": runs},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
