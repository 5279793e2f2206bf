"""Whole-model prefill through the packed expert kernels (kernels/packed_moe.py) on int8 and int4
experts against the CPU experts' prefill. Without a GPU the "GPU" is the CPU device and the
kernels run under Triton's interpreter (tests/conftest.py); there `unpack_reason` refuses the
CPU device, so the streamer would unpack to bf16: these tests set its `packed_kernel` and check
that every layer's streamed experts went through `packed_moe` on their packed bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement import layer_stream
from hetmoe.inject.rules import shipped_rules_path

pytest.importorskip("triton", reason="the packed kernels need Triton (pip install triton)")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host compiles the "
                                "kernels for CUDA tensors, not the CPU device's (no interpreter)")

PROMPT = [17, 3, 140, 62]
"""Four tokens: each interpreted kernel call takes ~1.4 s on 2 cores (one per MoE layer)."""
FORMAT_RTOL = {"int8": 0.025, "int4": 0.03}
"""|Δlogits| / max |logit| of the kernels' prefill against the CPU experts'. Both read the same
packed weights, but the CPU's int kernels also quantize each row's activations (per group)
while the kernels dequantize the weights alone to bf16: measured 0.004-0.015 (int8) and
0.005-0.011 (int4) of the baby models' logits of ~11 (4 and 16 tokens, qwen3_moe and
deepseek_v2), as far as the torch unpack path of the same bytes is from the CPU's (bf16 experts:
3e-7). A pair lost or computed with another expert moves them by > 0.05."""
KERNEL_RTOL = 0.006
"""|Δlogits| / max |logit| of the kernels against the torch unpack path of the same bytes (the
same dequantized weights): only the bf16 rounding of x and of the intermediate differs (the
interpreter truncates, torch rounds to nearest); measured <= 0.0035 in both formats."""


@pytest.fixture(scope="module")
def llm_with(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], LLM]:
    """`llm_with(family, format)`: an fp32 CPU `LLM` whose routed experts are `cpu` in that
    packed format."""

    def get(family: str, fmt: str) -> LLM:
        rules = tmp_path_factory.mktemp("rules") / f"{family}_{fmt}.yaml"
        rules.write_text(Path(shipped_rules_path(family)).read_text().replace(
            "kwargs: {experts: auto}", f"kwargs: {{experts: cpu, weight_format: {fmt}}}"))
        return LLM(tiny_dir(family), device="cpu", dtype="float32", rules=rules,
                   progress=False, max_seq_len=64)

    return get


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The format of every `packed_moe` call the streamer makes while the test runs."""
    calls: list[str] = []
    real = layer_stream.packed_moe

    def counted(*args: object, **options: object) -> torch.Tensor:
        calls.append(str(args[5]))  # x, ids, weights, packed, part, fmt, ...
        return real(*args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_stream, "packed_moe", counted)
    yield calls


def _prefill(runner: ModelRunner, streamed: bool) -> torch.Tensor:
    """PROMPT's prefill logits [T, V]: its experts streamed through the packed kernels, or on
    the CPU experts."""
    overlap = runner.overlap
    assert overlap is not None
    runner.lengths[0] = 0
    if not streamed:
        return runner.prefill_logits(0, PROMPT)
    streamer = overlap.make_streamer()
    assert not streamer.packed_kernel  # the CPU device: the unpack path unless told
    streamer.packed_kernel = True
    with overlap.streamed(len(PROMPT)):
        return runner.prefill_logits(0, PROMPT)


@pytest.mark.parametrize(("family", "fmt"), [
    ("qwen3_moe", "int8"), ("qwen3_moe", "int4"),  # GQA
    ("deepseek_v2", "int8"), ("deepseek_v2", "int4"),  # MLA
])
def test_prefill_through_the_packed_kernels_equals_the_cpu_experts(
        llm_with: Callable[[str, str], LLM], kernel_calls: list[str], family: str,
        fmt: str) -> None:
    llm = llm_with(family, fmt)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64,
                         EngineConfig(gpu_expert_bytes=0, prefill_experts="cpu"))
    try:
        assert runner.overlap is not None
        layers = len(runner.overlap.cpu)
        assert {m.weight_format for m in runner.overlap.cpu} == {fmt}
        cpu = _prefill(runner, streamed=False)
        assert kernel_calls == []
        gpu = _prefill(runner, streamed=True)
        assert kernel_calls == [fmt] * layers  # every layer's experts, one NUMA group each
        runner.overlap.make_streamer().packed_kernel = False
        with runner.overlap.streamed(len(PROMPT)):
            runner.lengths[0] = 0
            unpacked = runner.prefill_logits(0, PROMPT)  # torch: no kernel call
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()
    assert kernel_calls == [fmt] * layers
    scale = cpu.abs().max().item()
    delta = (gpu - cpu).abs().max().item()
    assert delta <= FORMAT_RTOL[fmt] * scale, f"{family} {fmt}: |Δlogits| {delta:.3g}"
    delta = (gpu - unpacked).abs().max().item()
    assert delta <= KERNEL_RTOL * scale, f"{family} {fmt}: |Δlogits| {delta:.3g} to the unpack"
    assert int(gpu[-1].argmax()) == int(cpu[-1].argmax())
