"""Bench pieces on the CPU: random real-shape builder (shrunk), shapes, trace, `hetmoe bench`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.bench.measure import greedy_decode, routed_bytes_per_token
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import SHAPES, routed_expert_shape, shape_config
from hetmoe.bench.trace import TraceRecorder
from hetmoe.cli import app
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.experts.torch_backend import TorchExperts
from hetmoe.ops.moe import moe_layers
from hetmoe.presets.tiny import tiny_config

PROMPT = [5, 9, 33, 100, 7]
"""Prompt token ids (inside the baby vocabulary)."""


def test_shapes_have_the_published_sizes() -> None:
    qwen = shape_config("qwen3-30b-a3b")
    assert (qwen.num_hidden_layers, qwen.num_experts, qwen.num_experts_per_tok,
            qwen.hidden_size, qwen.moe_intermediate_size) == (48, 128, 8, 2048, 768)
    lite = shape_config("deepseek-v2-lite", num_layers=3)
    assert (lite.num_hidden_layers, lite.n_routed_experts, lite.n_shared_experts,
            lite.num_experts_per_tok, lite.moe_intermediate_size) == (3, 64, 2, 6, 1408)
    assert set(SHAPES) == {"qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b",
                           "deepseek-v3-few-layers"}
    with pytest.raises(ValueError, match="unknown shape 'qwen9'; expected one of qwen3-30b-a3b"):
        shape_config("qwen9")
    # What bench_cpu_moe --shape builds: (routed experts, hidden, expert width, top-k).
    assert routed_expert_shape("qwen3-30b-a3b") == (128, 2048, 768, 8)
    assert routed_expert_shape("deepseek-v2-lite") == (64, 2048, 1408, 6)
    assert routed_expert_shape("mixtral-8x7b") == (8, 4096, 14336, 2)
    assert routed_expert_shape("deepseek-v3-few-layers") == (256, 7168, 2048, 8)
    with pytest.raises(ValueError, match="unknown shape 'qwen9'"):
        routed_expert_shape("qwen9")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize(("experts", "weight_format"), [("cpu", "bf16"), ("cpu", "int8"),
                                                        ("torch-cpu", "bf16")])
def test_random_model_is_complete_and_runs(family: str, experts: str, weight_format: str) -> None:
    config = tiny_config(family)
    model = build_random_model(config, torch.device("cpu"), torch.bfloat16, experts,
                               weight_format)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    on_meta = [n for n, t in tensors.items() if t.device.type == "meta"]
    assert on_meta == []
    layers = moe_layers(model)
    assert layers and all(m.experts.missing() == [] for m in layers)
    k, h = config.num_experts_per_tok, config.hidden_size
    i = config.moe_intermediate_size
    per_layer = routed_bytes_per_token(model) / len(layers)
    if experts == "torch-cpu":
        assert all(isinstance(m.experts, TorchExperts) for m in layers)
        assert all(m.experts.device.type == "cpu" for m in layers)
        assert per_layer == k * 3 * h * i * 2
    else:
        moe = cpu_moe_of(layers[0].experts)
        assert moe.weight_format == weight_format
        assert per_layer == int(moe.packed_bytes / config.num_experts * k)  # K experts' packing
    from hetmoe.engine.executor.runner import ModelRunner

    runner = ModelRunner(model, torch.device("cpu"), torch.bfloat16, 1, 16)
    logits = runner.prefill(0, PROMPT)
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_random_model_routes_tokens_over_many_experts_at_every_depth() -> None:
    """Routers of the random model spread a prompt's tokens as trained ones do, in the last
    layer as in the first (with N(0, 0.02) everywhere, 12 layers of the Qwen3 shape fell from
    123 to 22 distinct experts per 512 tokens)."""
    config = shape_config("qwen3-30b-a3b", num_layers=8)
    config.hidden_size, config.moe_intermediate_size, config.num_experts = 256, 64, 32
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    model = build_random_model(config, torch.device("cpu"), torch.bfloat16, "cpu", "int8")
    picked: list[torch.Tensor] = []
    hooks = [m.gate.register_forward_hook(lambda mod, a, out: picked.append(out[0]))
             for m in moe_layers(model)]
    ids = torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
    try:
        ModelRunner(model, torch.device("cpu"), torch.bfloat16, 1, 300).prefill(0, ids.tolist())
    finally:
        for hook in hooks:
            hook.remove()
    distinct = [int(p.unique().numel()) for p in picked]  # per layer, of 32 experts
    assert len(distinct) == 8 and min(distinct) >= 30, distinct


def test_random_model_refuses_quantized_torch_experts() -> None:
    with pytest.raises(ValueError, match="plain-torch experts are bf16 only, got "
                       "weight_format='int8'"):
        build_random_model(tiny_config("mixtral"), torch.device("cpu"), torch.bfloat16,
                           "torch-cpu", "int8")


def test_trace_has_gpu_and_cpu_spans_per_layer(engine: Callable[[str, str], LLM],
                                               tmp_path: Path) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, llm.max_seq_len,
                         EngineConfig(deferred=1))
    recorder = TraceRecorder(cuda=False)
    try:
        runner.lengths[0] = 0
        token = int(runner.prefill(0, PROMPT).argmax())
        runner.overlap.trace = recorder
        for _ in range(2):
            recorder.begin_step()
            token = int(runner.decode([0], [token])[0].argmax())
    finally:
        runner.overlap.detach()
        runner.overlap.trace = None
    summary = recorder.write(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    layers = len(runner.overlap.layers)
    for layer in range(layers):
        assert {f"attention L{layer}", f"shared L{layer}", f"experts L{layer}"} <= names
    assert "deferred L0" in names and f"deferred L{layers - 1}" not in names
    assert summary["count_per_step"]["experts"] == layers
    assert summary["count_per_step"]["deferred"] == layers - 1
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    assert summary["step_us"] > 0


def test_greedy_decode_times_steps_after_the_first(engine: Callable[[str, str], LLM]) -> None:
    runner = engine("mixtral", "cpu").runner
    run = greedy_decode(runner, PROMPT, 5)
    assert len(run.tokens) == 5 and len(run.step_s) == 3
    assert run.tok_s > 0 and run.mean_tok_s > 0


def test_bench_command_on_a_preset(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, [
        "bench", "tiny-qwen3-moe", "--new-tokens", "4", "--prefill", "16", "--no-eager",
        "--deferred", "0,1", "--json", str(out), "--bandwidth-gib", "0.0625",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["decode"]) == {"eager_d0", "eager_d1"}  # no GPU: no graphs
    assert data["read_gb_s"] > 0 and data["bound_tok_s"] > 0
    assert data["pool_read_gb_s"] > 0 and data["pool_bound_tok_s"] > 0
    assert data["decode"]["eager_d0"]["timed_steps"] == 2
    for entry in data["decode"].values():  # the pool's reads just before and after each run
        assert len(entry["read_gb_s_around"]) == 2 and min(entry["read_gb_s_around"]) > 0
        assert entry["of_adjacent_bound"] == pytest.approx(
            entry["tok_s"] * data["routed_bytes_per_token"]
            / (max(entry["read_gb_s_around"]) * 1e9), rel=0.02, abs=1e-3)
    windows = data["decode_windows"]  # every step within the smallest bucket (capped)
    assert windows["smallest"] == 256 and windows["capture_ms"] == {}
    # 3 decode steps (4 new tokens) per deferred value
    assert windows["steps"] == {str(min(256, windows["max_seq_len"])): 6}
    assert "16" in data["prefill_tok_s"]
    assert "tiny-qwen3-moe" in result.output


def test_bench_command_errors() -> None:
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 1
    assert "bench takes a MODEL or --random-weights SHAPE (exactly one)" in result.output
    result = CliRunner().invoke(app, ["bench", "--random-weights", "qwen3-30b-a3b",
                                      "--deferred", "x"])
    assert result.exit_code != 0 and "comma-separated integers" in result.output


def test_bench_command_places_experts_as_generate_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe.bench import harness
    from hetmoe.bench.bench_config import BenchConfig

    seen: list[BenchConfig] = []
    monkeypatch.setattr(harness, "run_bench", lambda cfg, log: seen.append(cfg) or {})
    monkeypatch.setattr(harness, "table", lambda results: "table")
    for extra, budget in (([], "auto"), (["--gpu-expert-gib", "0"], 0),
                          (["--gpu-expert-gib", "0.5"], 2**29)):
        result = CliRunner().invoke(app, ["bench", "--random-weights", "qwen3-30b-a3b", *extra])
        assert result.exit_code == 0, result.output
        assert seen[-1].gpu_expert_bytes == budget
    assert BenchConfig(shape="qwen3-30b-a3b").gpu_expert_bytes == "auto"


def test_bench_hybrid_times_the_cpu_path_with_no_resident_experts(tmp_path: Path) -> None:
    import argparse
    import runpy

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "bench_hybrid.py"
    mode_args = runpy.run_path(str(script))["mode_args"]
    args = argparse.Namespace(shape="qwen3-30b-a3b", prompt_len=32, num_layers=None, deferred="0",
                              new_tokens=8, prefill="128", no_eager=True, no_alternatives=True)
    for mode in ("cpu-bf16", "cpu-int8"):
        got = mode_args(mode, args, tmp_path)
        assert got[got.index("--gpu-expert-gib") + 1] == "0"
