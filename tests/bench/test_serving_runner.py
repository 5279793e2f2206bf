"""bench/serving_runner.py on the CPU: the runner bench_serve.py and bench_batch.py drive, from a
random-weight shape (shrunk to the baby config) or a preset, with the options they pass."""

from __future__ import annotations

import argparse

import pytest
import torch

from hetmoe.bench import serving_runner as module
from hetmoe.bench.serving_runner import serving_runner
from hetmoe.experts.torch_backend import TorchExperts
from hetmoe.ops.moe import moe_layers
from hetmoe.presets.tiny import tiny_config


def script_args(model: str | None) -> argparse.Namespace:
    return argparse.Namespace(model=model, shape="qwen3-30b-a3b", num_layers=None,
                              weight_format="bf16", seed=0)


def test_a_shape_gets_the_options_and_graph_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, int | None]] = []

    def baby(shape: str, num_layers: int | None) -> object:
        asked.append((shape, num_layers))
        return tiny_config("qwen3_moe")

    monkeypatch.setattr(module, "shape_config", baby)
    runner = serving_runner(script_args(None), 4, 48, {"gpu_expert_bytes": 0}, "torch-cpu",
                            graph_batch_sizes=(1, 2, 4))
    assert asked == [("qwen3-30b-a3b", None)]
    assert (runner.max_batch, runner.max_seq_len) == (4, 48)
    assert (runner.config.graph_batch_sizes, runner.config.gpu_expert_bytes) == ((1, 2, 4), 0)
    assert all(isinstance(m.experts, TorchExperts) for m in moe_layers(runner.model))
    # bench_batch.py's options, graph sizes left to the engine's default.
    runner = serving_runner(script_args(None), 2, 32, {"gpu_expert_bytes": 0,
                                                       "prefill_chunk": 64})
    assert (runner.config.prefill_chunk, runner.config.graph_batch_sizes) == (64, (1, 2, 4, 8))


def test_a_preset_is_opened_by_the_engine_with_the_options() -> None:
    runner = serving_runner(script_args("tiny-qwen3-moe"), 2, 40,
                            {"gpu_expert_bytes": 0, "prefill_chunk": 64})
    assert (runner.max_batch, runner.max_seq_len, runner.config.prefill_chunk) == (2, 40, 64)
    assert runner.device == torch.device("cpu")


def test_stream_settings_and_what_the_decode_tuner_kept() -> None:
    from types import SimpleNamespace

    from hetmoe.bench.serving_runner import decode_streaming, stream_settings
    from hetmoe.engine.executor.prefill_planner import NEVER
    from hetmoe.engine.placement.decode_split import DecodeTuner

    assert stream_settings("0,auto,64") == [0, "auto", 64]
    with pytest.raises(argparse.ArgumentTypeError, match="auto or rows >= 0 expected, got '-1'"):
        stream_settings("auto,-1")
    tuner = DecodeTuner()
    tuner.weighed = {8: (0, 40, 48), 9: (0, 50)}  # 128-255 rows settled, 256-511 weighing
    for k, seconds in ((0, 3.0), (40, 1.0), (48, 2.0), (0, 4.0), (40, 1.5), (48, 2.5)):
        tuner.record(128, k, seconds)
    tuner.record(256, 0, 1.0)
    planner = SimpleNamespace(decode_rows=26, decode_tuner=tuner)
    runner = SimpleNamespace(planner=planner, max_batch=256)
    assert decode_streaming(runner) == {  # type: ignore[arg-type]
        "decode_rows": 26, "decode_ks": {"128": 40, "256": "weighing"}}
    planner.decode_rows = NEVER
    assert decode_streaming(runner) == {"decode_rows": None, "decode_ks": {}}  # type: ignore[arg-type]
