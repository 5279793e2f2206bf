"""The decode projections' kernels on the GPU (`pytest -m device`): at the Qwen3-30B-A3B shapes
(qkv 5120 x 2048 after the norm, o_proj 2048 x 4096) and rows 1..8, against cuBLAS behind torch's
ops (the norm's output within one bf16 rounding; the products within one rounding plus fp32
summation's bound, `assert_sums_agree`: tensor cores and cuBLAS sum in other orders, and where
an output cancels to near zero one ulp is far below that) and within the float64 bound, at the
shipped launch shapes by rows and the sweep's ends (dot and FMA); inside a compiled function
captured as a CUDA graph (as the decode step runs them), replayed on new inputs, equal to the
same calls run eagerly; and the compiled fused decode step of a baby bf16 model with and without
them (same greedy tokens)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_gemv_decode_step import ATOL, PROMPTS, decode
from test_gemv_kernels import EPS, assert_sums_agree, check_against_torch_ops, reference_norm_gemv

from hetmoe import LLM
from hetmoe.bench.cuda_graphs import capture
from hetmoe.engine.executor import fused_decode
from hetmoe.kernels import gemv_config
from hetmoe.kernels.gemv_config import GemvConfig
from hetmoe.kernels.gemv_residual import gemv_residual
from hetmoe.kernels.norm_gemv import norm_gemv
from hetmoe.ops import fused

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

CONFIGS = [None, GemvConfig(16, 512, 1, 4, 4), GemvConfig(16, 256, 2, 4, 4),
           GemvConfig(64, 128, 4, 8, 3), GemvConfig(32, 1024, 1, 8, 2),
           GemvConfig(4, 512, 2, 4, 4, dot=False), GemvConfig(8, 256, 1, 4, 3, dot=False)]
"""None: the shipped shape for the rows (`config_for`)."""


def real(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [M, K], norm [K], weight [N, K], h [M, N] bf16 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    norm = torch.rand(k, device="cuda", generator=g) + 0.5
    weight = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    h = torch.randn(m, n, device="cuda", generator=g)
    return tuple(t.bfloat16() for t in (x, norm, weight, h))


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(
    str(int(v)) for v in vars(c).values()) if c else "shipped")
def test_real_shapes_against_cublas_and_float64(m: int, config: GemvConfig | None) -> None:
    x, norm, weight, _ = real(m, 5120, 2048, seed=m)
    got = norm_gemv(x, norm, EPS, weight, config=config)
    want, bound = reference_norm_gemv(x, norm, weight, None)
    assert ((got.double() - want).abs() <= bound).all()
    check_against_torch_ops(got, x, norm, weight, None, config)
    a, _, w_o, h = real(m, 2048, 4096, seed=100 + m)
    plain = gemv_residual(a, w_o, config=config)
    assert_sums_agree(plain, fused.linear(a, w_o, None), a, w_o)
    assert torch.equal(gemv_residual(a, w_o, h, config=config), h + plain)


def test_compiled_in_a_cuda_graph_equals_eager() -> None:
    """Both ops inside one torch.compile'd function (Inductor keeps the triton_ops in its graph),
    captured once and replayed on new inputs copied into the captured ones."""
    x, norm, weight, _ = real(3, 5120, 2048, seed=1)
    _, _, w_o, h = real(3, 2048, 4096, seed=2)

    def step(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        qkv = norm_gemv(x, norm, EPS, weight)
        return gemv_residual(qkv[:, :4096], w_o, h)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    compiled(x, h)  # compile
    graph, out = capture(lambda: compiled(x, h), warmup=0)
    x.copy_(torch.randn_like(x))
    h.copy_(torch.randn_like(h))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step(x, h))


def test_compiled_decode_step_with_and_without_the_kernels(
        tiny_dir: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny_dir("qwen3_moe", mlp_only_layers=[0]), device="cuda", dtype="bfloat16",
              experts="cpu", progress=False, max_seq_len=32, gpu_expert_bytes=0)
    monkeypatch.setattr(fused_decode, "_FUNCTIONS", {})  # compiled for this test alone
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 8)  # the kernels (off by default)
    tokens, logits = decode(llm, PROMPTS, compiled=True)
    monkeypatch.setattr(fused_decode, "_FUNCTIONS", {})
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 0)
    want_tokens, want = decode(llm, PROMPTS, compiled=True)
    assert tokens == want_tokens
    for ours, ref in zip(logits, want, strict=True):
        # two bf16 roundings of the largest logit: a compiled step's sums in another order move
        # a logit of ~10 by its ulp (0.0625), more than the interpreter's ATOL allows
        assert (ours - ref).abs().max().item() <= max(ATOL, 2 ** -6 * ref.abs().max().item())
