"""Distinct experts per ubatch (bench/expert_count.py): counts against the ids the experts were
given on a baby model, the used-experts copy's bytes and floor, a GGUF's per-expert bytes,
`open_bench_model`'s refusal of a format for a directory, and bench_prefill.py counting each
prompt once (its summary reuses a count; --count-only keeps every expert in host memory)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bench_script import load_script

from hetmoe import LLM
from hetmoe.bench.bench_model import open_bench_model
from hetmoe.bench.expert_count import (
    count_row,
    distinct_per_ubatch,
    distinct_summary,
    gguf_expert_bytes,
    packed_expert_bytes,
)
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.moe import moe_layers


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_torch_thread: None) -> None:
    """Baby tensors: one torch thread."""


def test_distinct_per_ubatch_counts_each_run_of_tokens() -> None:
    picks = torch.tensor([[0, 1], [1, 2], [2, -1], [5, 5], [7, 0]])
    assert distinct_per_ubatch(picks, 2) == [3, 2, 2]  # {0,1,2}, {2,5} (-1 no expert), {7,0}
    assert distinct_per_ubatch(picks, 5) == [5]  # {0, 1, 2, 5, 7}
    assert distinct_per_ubatch(picks, 1) == [2, 2, 1, 1, 2]
    with pytest.raises(ValueError, match="ubatch must be >= 1 token, got 0"):
        distinct_per_ubatch(picks, 0)


def recording(sink: list[torch.Tensor], submit: Any) -> Any:
    """`submit` that first keeps a copy of the expert ids [T, K] it is given."""
    def record(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any:
        sink.append(ids.clone())
        return submit(x, ids, weights)
    return record


def test_count_row_is_the_ids_the_experts_were_given(tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", progress=False)
    runner = llm.runner
    layers = moe_layers(runner.model)
    given: list[list[torch.Tensor]] = [[] for _ in layers]
    for i, moe in enumerate(layers):
        moe.experts.submit = recording(given[i], moe.experts.submit)
    try:
        sizes = {"packed": packed_expert_bytes(runner.model), "other": [1000.0] * len(layers)}
        experts = layers[0].experts.spec.num_experts
        row = count_row(runner, 23, runner.vocab_size, experts, sizes, h2d=1e6, ubatch=8)
    finally:
        for moe in layers:
            del moe.experts.submit
    want = [[int(torch.cat(g)[s:s + 8].unique().numel()) for s in (0, 8, 16)] for g in given]
    assert row["distinct_per_layer"] == want
    assert (row["tokens"], row["ubatch"], row["ubatches"], row["experts"]) == (23, 8, 3, experts)
    means = sorted(sum(c) / 3 for c in want)
    assert row["distinct"]["min"] == round(means[0], 1)
    assert row["distinct"]["max"] == round(means[-1], 1)
    per_expert = [cpu_moe_of(m.experts).packed_bytes / experts for m in layers]
    assert sizes["packed"] == per_expert
    used = sum(b * sum(c) for b, c in zip(per_expert, want, strict=True))
    assert row["packed"]["used_bytes"] == int(used)
    assert row["packed"]["all_bytes"] == int(sum(per_expert) * experts * 3)
    assert row["other"]["used_bytes"] == 1000 * sum(map(sum, want))
    assert row["other"]["used_floor_tok_s"] == round(23 * 1e6 / row["other"]["used_bytes"], 1)
    with pytest.raises(ValueError, match="packed: bytes for 1 MoE layers, the model routes in 2"):
        count_row(runner, 4, runner.vocab_size, experts, {"packed": [1.0]})


def write_gguf(path: Path, layers: int, experts: bool) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((8, 8), np.float32))
        if experts:  # numpy order [E, rows, cols]: 4 experts
            writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.zeros((4, 6, 8), np.float32))
            writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.zeros((4, 6, 8), np.float32))
            writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", np.zeros((4, 8, 6 + i),
                                                                        np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_expert_bytes_are_one_experts_blocks_per_layer(tmp_path: Path) -> None:
    write_gguf(tmp_path / "moe.gguf", 2, experts=True)
    assert gguf_expert_bytes(tmp_path / "moe.gguf") == [(48 + 48 + 48) * 4, (48 + 48 + 56) * 4]
    write_gguf(tmp_path / "dense.gguf", 1, experts=False)
    with pytest.raises(ValueError, match=r"dense.gguf: no ffn_\*_exps tensors \(not a MoE GGUF\)"):
        gguf_expert_bytes(tmp_path / "dense.gguf")


def test_a_weight_format_is_for_a_gguf_only(tiny_dir: Callable[..., Path]) -> None:
    path = tiny_dir("qwen3_moe")
    with pytest.raises(ValueError, match="a weight format applies to a GGUF file"):
        open_bench_model(str(path), torch.device("cpu"), "int4", 32)


def counting_prefills(runner: Any) -> list[int]:
    """The lengths of the prompts `runner` prefills from now on (its prefill wrapped)."""
    seen: list[int] = []
    prefill = runner.prefill

    def record(slot: int, ids: list[int]) -> Any:
        seen.append(len(ids))
        return prefill(slot, ids)

    runner.prefill = record
    return seen


def test_distinct_summary_counts_a_prompt_once(tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", progress=False)
    runner = llm.runner
    config = llm.model.config
    experts = int(config.num_experts)
    seen = counting_prefills(runner)
    try:
        rows = [count_row(runner, n, runner.vocab_size, experts, {}) for n in (23, 40)]
        assert seen == [23, 40]
        got = distinct_summary(runner, config, 40, rows)  # the row of that prompt: no prefill
        assert seen == [23, 40]
        assert got == {"mean": rows[1]["distinct_mean"], "min": rows[1]["distinct"]["min"],
                       "max": rows[1]["distinct"]["max"]}
        again = distinct_summary(runner, config, 40)  # no rows: counted here, the same ids
        assert seen == [23, 40, 40] and again == got
        per_layer = [sum(c) / len(c) for c in rows[1]["distinct_per_layer"]]
        assert got["mean"] == round(sum(per_layer) / len(per_layer), 1)
        assert got["max"] == round(max(per_layer), 1) and got["min"] == round(min(per_layer), 1)
        other_ubatch = [count_row(runner, 40, runner.vocab_size, experts, {}, ubatch=8)]
        distinct_summary(runner, config, 40, other_ubatch)  # another ubatch: counted again
        assert seen == [23, 40, 40, 40, 40]
    finally:
        del runner.prefill


def test_count_only_counts_once_with_every_expert_in_host_memory(
        tiny_dir: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("engine/bench_prefill.py")
    configs: list[EngineConfig] = []
    prefills: list[list[int]] = []

    class Runner(ModelRunner):
        def __init__(self, *args: Any) -> None:
            configs.append(args[-1])
            super().__init__(*args)
            prefills.append(counting_prefills(self))

    monkeypatch.setattr(script, "ModelRunner", Runner)
    args = argparse.Namespace(model=str(tiny_dir("qwen3_moe")), weight_format=None, group=None,
                              shape=None, num_layers=None, ubatch=8, out=tmp_path)
    result = script.count_only(args, [23])
    assert [c.gpu_expert_bytes for c in configs] == [0]
    assert prefills == [[23]]
    written = json.loads(next(tmp_path.glob("experts_*.json")).read_text())
    assert written["expert_counts"] == result["expert_counts"]
    (row,) = result["expert_counts"]
    assert (row["tokens"], row["ubatch"], row["ubatches"]) == (23, 8, 3)
    assert all(1 <= n <= row["experts"] for layer in row["distinct_per_layer"] for n in layer)
