"""The runner the serving benchmarks drive (`benchmarks/serving/bench_serve.py`,
`bench_batch.py`): the hybrid runner over a random-weight real shape, or the engine's runner of
a checkpoint, built from the scripts' shared arguments; their `--stream-decode` settings and what
the decode tuner kept."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.engine import LLM
from hetmoe.engine.executor.runner import ModelRunner


def serving_runner(args: argparse.Namespace, max_batch: int, window: int,
                   options: dict[str, Any], experts: str = "cpu",
                   graph_batch_sizes: tuple[int, ...] | None = None) -> ModelRunner:
    """`args.model` (a checkpoint or preset) opened by `LLM` with the engine `options`, or
    `args.shape` with random weights (`args.num_layers`, `args.weight_format`, `args.seed`;
    routed experts in `experts`) under a runner of `EngineConfig(**options)`, with
    `graph_batch_sizes` if given (a checkpoint keeps the engine's); `max_batch` KV slots of
    `window` tokens either way."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model is not None:
        llm = LLM(args.model, device=device, progress=False, max_batch=max_batch,
                  max_seq_len=window, **options)
        return llm.runner
    config = shape_config(args.shape, args.num_layers)
    model = build_random_model(config, device, torch.bfloat16, experts, args.weight_format,
                               args.seed)
    engine = dict(options)
    if graph_batch_sizes is not None:
        engine["graph_batch_sizes"] = graph_batch_sizes
    return ModelRunner(model, device, torch.bfloat16, max_batch, window, EngineConfig(**engine))


def number_list(kind: Callable[[str], Any], least: int) -> Callable[[str], list[Any]]:
    """An argparse type: "1,4,16" as a list of `kind` values >= `least`."""
    def parse(text: str) -> list[Any]:
        values = [kind(v) for v in text.split(",")]
        if min(values) < least:
            raise argparse.ArgumentTypeError(f"numbers >= {least} expected, got {text!r}")
        return values
    return parse


def stream_settings(text: str) -> list[int | str]:
    """An argparse type: "0,auto" as `EngineConfig.stream_decode_rows` values (auto or rows)."""
    values: list[int | str] = []
    for value in text.split(","):
        if value != "auto" and not value.isdigit():
            raise argparse.ArgumentTypeError(f"auto or rows >= 0 expected, got {value!r}")
        values.append(value if value == "auto" else int(value))
    return values


def decode_streaming(runner: ModelRunner) -> dict[str, Any]:
    """The runner's decode-step streaming so far: the rows from which steps weigh it (None:
    never) and, per row bucket (by its fewest rows), the k the decode tuner kept (0: the decode
    path) or "weighing"."""
    planner = runner.planner
    if planner is None or planner.decode_rows > runner.max_batch:
        return {"decode_rows": None, "decode_ks": {}}
    tuner, kept = planner.decode_tuner, dict[str, int | str]()
    for bucket in tuner.weighed:
        kept[str(1 << (bucket - 1))] = tuner.fastest(bucket) if tuner.settled(bucket) \
            else "weighing"
    return {"decode_rows": planner.decode_rows, "decode_ks": kept}
