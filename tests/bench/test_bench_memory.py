"""`hetmoe bench --random-weights` refuses a shape this machine's memory cannot hold, up front."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hetmoe.bench import memory
from hetmoe.cli import app
from hetmoe.loading import memory_plan

CPU = torch.device("cpu")
PROBE = 2**31
"""The default 2 GiB read-bandwidth probe."""


def _available(monkeypatch: pytest.MonkeyPatch, gb: float) -> None:
    monkeypatch.setattr(memory_plan, "host_available", lambda: int(gb * 1e9))


def test_the_plan_counts_experts_weights_kv_and_what_the_bench_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _available(monkeypatch, 100)
    plan = memory.bench_plan("qwen3-30b-a3b", 2, CPU, "bf16", 400, PROBE)
    experts = 2 * 128 * 3 * 2048 * 768 * 2  # layers x E x (gate, up, down) x H x I x bf16
    kv = 400 * 2 * 2 * 4 * 128 * 2  # tokens x layers x (K, V) x kv heads x head dim x bf16
    assert dict((name, b) for name, _, b in plan.rows) == {
        "routed experts (bf16, packed)": experts,
        "other weights": 1321227520,
        "KV cache (400 tokens)": kv,
        "staging (one layer's experts, bf16)": experts // 2,
        "read-bandwidth probe": PROBE,
        "process (torch, activations)": memory.PROCESS_BYTES,
    }
    assert plan.host_free == 100e9 and plan.refusal() == ""


def test_a_shape_too_big_is_refused_with_the_layers_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _available(monkeypatch, 23)
    with pytest.raises(ValueError) as info:
        memory.check_memory("qwen3-30b-a3b", None, CPU, "bf16", 400, PROBE)
    message = str(info.value)
    assert message.startswith("bench --random-weights qwen3-30b-a3b with 48 layers: the model "
                              "does not fit: host memory: needs 64.96 GB, 23.00 GB available [")
    assert message.endswith("]; --num-layers 14 fits (or fewer bytes per expert: "
                            "--weight-format int8 or int4)")
    assert memory.bench_plan("qwen3-30b-a3b", 14, CPU, "bf16", 400, PROBE).refusal() == ""
    assert memory.bench_plan("qwen3-30b-a3b", 15, CPU, "bf16", 400, PROBE).refusal() != ""


def test_int8_experts_are_pointed_to_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, 23)
    with pytest.raises(ValueError, match=r"; --num-layers 26 fits \(or fewer bytes per expert: "
                       r"--weight-format int4\)$"):
        memory.check_memory("qwen3-30b-a3b", None, CPU, "int8", 400, PROBE)


def test_when_not_one_layer_fits_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"; not even one layer fits$"):
        memory.check_memory("qwen3-30b-a3b", 4, CPU, "int4", 400, PROBE)


def test_the_command_refuses_before_measuring_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, 23)
    result = CliRunner().invoke(app, ["bench", "--random-weights", "qwen3-30b-a3b"])
    assert result.exit_code == 1
    assert "host memory: needs 64.96 GB, 23.00 GB available" in result.output
    assert "--num-layers 14 fits" in result.output
    assert "host read bandwidth" not in result.output  # refused before the 2 GiB read probe
