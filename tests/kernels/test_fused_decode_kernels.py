"""The fused decode step (engine/executor/fused_decode.py, eager) with its Triton kernels (q/k
norms, rope, attention and cache write by kernels/gqa_decode.py; residual, norm, router and pack by
kernels/moe_router.py) against the same step in torch ops: batched greedy decode on the baby
GQA families (q/k norms, a sliding window, sliding and full layers in one model, a shared
expert), rows at different positions, across window buckets (1 to 3 splits). Uncompiled, on
the GPU when there is one, else under Triton's interpreter (tests/kernels/conftest.py); the
compiled step is a device test (tests/engine/test_graph_device.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from decode_rows import greedy_rows

from hetmoe import LLM, env
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.fused_decode import FusedDecoder
from hetmoe.engine.executor.runner import ModelRunner

HERE = "cuda" if torch.cuda.is_available() else "cpu"

PROMPTS = [[5, 9, 33, 100, 7], [11, 12, 13], [(7 * i) % 200 + 1 for i in range(121)]]
"""The third row crosses 128 cache entries: windows of 64, 128 and 160 entries."""
STEPS = 10
ATOL = 1e-2
"""fp32 on both sides, the same C++ experts: only summation orders differ, which
can flip one bf16 rounding of an expert input (tests/engine/decode_steps.py SAME_BACKEND_ATOL);
a wrong window or cache entry moves the logits by 0.1 or more."""


def decode(llm: LLM, kernels: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode of PROMPTS together (window buckets from 32 entries up) -> tokens, logits."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, len(PROMPTS), llm.max_seq_len,
                         EngineConfig(smallest_window=32))
    assert runner.overlap is not None and runner.fused is not None
    runner.fused = fused = FusedDecoder(llm.model, runner.overlap, compile=False,
                                        kernels=kernels)
    try:
        out = greedy_rows(runner, PROMPTS, STEPS)
    finally:
        runner.overlap.detach()
    # the kernels' router ran in its one launch, over tickets it left at zero
    assert [t.count_nonzero().item() for t in fused.tickets] == ([0] if kernels == "triton"
                                                                  else [])
    return out


@pytest.mark.parametrize(("family", "config"), [
    ("qwen3_moe", {}),
    ("mixtral", {"sliding_window": 6}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
])
def test_kernel_step_equals_the_torch_step(tiny_dir: Callable[..., Any], family: str,
                                           config: dict[str, Any]) -> None:
    llm = LLM(tiny_dir(family, **config), device=HERE, dtype="float32", experts="cpu",
              progress=False, max_seq_len=160, gpu_expert_bytes=0)
    want_tokens, want = decode(llm, "torch")
    tokens, logits = decode(llm, "triton")
    assert tokens == want_tokens
    for step, (ours, ref) in enumerate(zip(logits, want, strict=True)):
        delta = (ours - ref).abs().max().item()
        assert delta <= ATOL, f"{family} step {step}: max |Δlogits| {delta:.3g}"


def test_kernels_choice_is_checked(monkeypatch: pytest.MonkeyPatch,
                                     tiny_dir: Callable[..., Any]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device=HERE, dtype="float32", experts="cpu",
              progress=False, max_seq_len=32, gpu_expert_bytes=0)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, 32)
    assert runner.overlap is not None and runner.fused is not None
    try:  # the kernels by default on a GPU, torch ops when asked for, and always on the CPU
        assert runner.fused.kernels == ("triton" if HERE == "cuda" else "torch")
        monkeypatch.setenv("HETMOE_DECODE_KERNELS", "torch")
        assert FusedDecoder(llm.model, runner.overlap, compile=False).kernels == "torch"
        monkeypatch.setenv("HETMOE_DECODE_KERNELS", "triton")
        asked = FusedDecoder(llm.model, runner.overlap, compile=False).kernels
        assert asked == ("triton" if HERE == "cuda" else "torch")
        with pytest.raises(ValueError, match=r"kernels must be triton or torch, got 'flash'"):
            FusedDecoder(llm.model, runner.overlap, compile=False, kernels="flash")
        monkeypatch.setenv("HETMOE_DECODE_KERNELS", "flash")
        with pytest.raises(ValueError, match=r"HETMOE_DECODE_KERNELS must be triton or "
                                             r"torch, got 'flash'"):
            env.decode_kernels()
    finally:
        runner.overlap.detach()
