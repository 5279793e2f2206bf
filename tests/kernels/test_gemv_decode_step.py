"""The fused decode step (engine/executor/fused_decode.py, eager, its Triton path) in bf16 with the
projection kernels (kernels/norm_gemv.py for the input norm + q/k/v, kernels/gemv_residual.py
for o_proj) against the same step with torch's linear (`DECODE_GEMV_MAX_ROWS` = 0): batched
greedy decode of 3 rows on baby families with q/k norms and a dense first layer (o_proj with
the residual add as epilogue), and with q/k/v biases and a shared expert; and at more rows than
`DECODE_GEMV_MAX_ROWS`, where the step keeps torch's linear. Under Triton's interpreter without a
GPU (tests/kernels/conftest.py); the compiled, graph-captured step is a device test in
tests/kernels/test_gemv_kernels_device.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from decode_rows import greedy_rows

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.fused_decode import FusedDecoder
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.kernels import gemv_config, gemv_residual, norm_gemv

HERE = "cuda" if torch.cuda.is_available() else "cpu"

PROMPTS = [[5, 9, 33, 100, 7], [11, 12, 13], [(7 * i) % 200 + 1 for i in range(20)]]
STEPS = 3
ATOL = 0.05
"""bf16 logits of a baby model: the kernels and cuBLAS / the CPU's GEMM sum in other orders, so a
projected value may land one bf16 rounding apart (the kernel tests bound it to one), and the
logits move by a few of those; a wrong row, bias, norm or residual moves them by 0.5 or more."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of the kernels' launches (their ops, called through the module globals): norm_gemv,
    o_proj alone and o_proj with the residual add."""
    counts = {"norm_gemv": 0, "o_proj": 0, "o_proj+h": 0}
    qkv, o_proj = norm_gemv._norm_gemv_op, gemv_residual._gemv_op

    def count_qkv(*args: Any) -> torch.Tensor:
        counts["norm_gemv"] += 1
        return qkv(*args)

    def count_o_proj(*args: Any) -> torch.Tensor:
        counts["o_proj" if args[3] is None else "o_proj+h"] += 1  # args[3]: h
        return o_proj(*args)

    monkeypatch.setattr(norm_gemv, "_norm_gemv_op", count_qkv)
    monkeypatch.setattr(gemv_residual, "_gemv_op", count_o_proj)
    yield counts


def decode(llm: LLM, prompts: list[list[int]], steps: int = STEPS, compiled: bool = False
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode of `prompts` together on the fused step's Triton path (`compiled`: through
    torch.compile, a GPU's)."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, len(prompts), llm.max_seq_len,
                         EngineConfig(smallest_window=32))
    assert runner.overlap is not None and runner.fused is not None
    runner.fused = FusedDecoder(llm.model, runner.overlap, compile=compiled, kernels="triton")
    try:
        return greedy_rows(runner, prompts, steps)
    finally:
        runner.overlap.detach()


def compare(llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 8)  # the kernels (off by default)
    tokens, logits = decode(llm, prompts)
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 0)  # torch's linear
    want_tokens, want = decode(llm, prompts)
    assert tokens == want_tokens
    for step, (ours, ref) in enumerate(zip(logits, want, strict=True)):
        delta = (ours - ref).abs().max().item()
        assert delta <= ATOL, f"step {step}: max |Δlogits| {delta:.3g}"


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("family", "config", "dense"), [
    ("qwen3_moe", {"mlp_only_layers": [0]}, 1),
    ("qwen2_moe", {}, 0),
])
def test_kernel_projections_equal_torch_linear(tiny_dir: Callable[..., Any], family: str,
                                               config: dict[str, Any], dense: int,
                                               calls: dict[str, int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_dir(family, **config), device=HERE, dtype="bfloat16", experts="cpu",
              progress=False, max_seq_len=32, gpu_expert_bytes=0)
    layers = llm.model.config.num_hidden_layers
    compare(llm, PROMPTS, monkeypatch)
    # the first run's steps only: a norm_gemv and an o_proj a layer a step, the dense layers'
    # o_proj with the residual add (the MoE layers' add is moe_router's)
    assert calls == {"norm_gemv": layers * STEPS, "o_proj": (layers - dense) * STEPS,
                     "o_proj+h": dense * STEPS}


@pytest.mark.usefixtures("interpreted")
def test_more_rows_than_the_kernels_take_keep_torch_linear(
        tiny_dir: Callable[..., Any], calls: dict[str, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device=HERE, dtype="bfloat16", experts="cpu",
              progress=False, max_seq_len=32, gpu_expert_bytes=0)
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 2)
    decode(llm, [[5, 9], [11, 12], [13, 14]], steps=1)  # 3 rows
    assert calls == {"norm_gemv": 0, "o_proj": 0, "o_proj+h": 0}
