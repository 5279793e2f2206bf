"""Whole-model prefill through the packed expert kernels (kernels/packed_moe.py) on int8, int4 and
fp8 experts against the CPU experts' prefill. Without a GPU the "GPU" is the CPU device and the
kernels run under Triton's interpreter (tests/conftest.py); there `unpack_reason` refuses the
CPU device, so the streamer would unpack to bf16: these tests set its `packed_kernel` and check
that every layer's streamed experts went through `packed_moe` on their packed bytes.

Two paths whose experts differ by their format's legitimate rounding can still route a token
differently where a router's k-th and (k+1)-th scores nearly tie; the logits are compared at the
positions where every MoE layer routed alike, and every flip must be such a near tie."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement import layer_stream
from hetmoe.inject.rules import shipped_rules_path
from hetmoe.ops.router import Router

pytest.importorskip("triton", reason="the packed kernels need Triton (pip install triton)")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host compiles the "
                                "kernels for CUDA tensors, not the CPU device's (no interpreter)")

PROMPT = [17, 3, 140, 62]
"""Four tokens: each interpreted kernel call takes ~1.4 s on 2 cores (one per MoE layer)."""
LONG_PROMPT = [*PROMPT, 265, 125, 484, 15, 320, 369, 123]
"""Eleven tokens, the last of which deepseek_v3 int4 routes differently on the kernels and the
CPU experts (ROUTER_TIE); 13 of 84 random 16-token prompts flipped 1-3 positions of its last
MoE layer."""
FORMAT_RTOL = {"int8": 0.025, "int4": 0.03, "fp8": 2**-8}
"""|Δlogits| / max |logit| of the kernels' prefill against the CPU experts' at positions routed
alike. Both read the same packed weights, but the CPU's int kernels also quantize each row's
activations (per group) while the kernels dequantize the weights alone to bf16: measured
0.004-0.015 (int8) and 0.005-0.018 (int4) of the baby models' logits of ~11 (4 and 16 tokens,
qwen3_moe, deepseek_v2, deepseek_v3), as far as the torch unpack path of the same bytes is from
the CPU's (bf16 experts: 3e-7). fp8 quantizes no activation on either side: bf16 x times the e4m3
code (exact in bf16) with the block scale in fp32 is the same product on both, leaving the fp32
sums' order and a tie of the intermediate's bf16 rounding, so one bf16 step (2^-8) of the
largest logit bounds them: measured 3e-5 (qwen3_moe) and 3e-7 (deepseek_v3). A pair lost or
computed with another expert moves them by > 0.05."""
KERNEL_RTOL = 0.006
"""|Δlogits| / max |logit| of the kernels against the torch unpack path of the same bytes (the
same dequantized weights, but the unpack rounds fp8's code x scale to bf16): only the bf16
rounding of x and of the intermediate differs (the interpreter truncates, torch rounds to
nearest); measured <= 0.0043 (deepseek_v3 int4, 16 tokens)."""
ROUTER_TIE = 0.02
"""Largest gap, on the CPU path, between the scores of the experts two paths swap at a position.
deepseek_v3 int4, LONG_PROMPT: the CPU's activation quantization moves its first MoE layer's
output by up to 0.07 (of ~4; kernels and unpack differ by 0.017 there), the second layer's
router input by 0.04 (of ~3.3) and its choice scores by up to 0.0084. At position 10 (groups 0
and 2 kept) experts 0 and 4 scored 0.5806 / 0.5771 on the kernel path, 0.5802 / 0.5817 on the
CPU's: a gap of 0.0035 turned to -0.0015, so the kernels take expert 0, the CPU expert 4, and
that position's logits differ by 2.04 (the unpack path's alike; 0.22 at most elsewhere). With
the kernels' routing forced onto the CPU path they differ by 0.10: the flip is the whole gap."""
MAX_FLIPS = 2
"""Positions of a prompt that may route differently: measured one (deepseek_v3 int4, position 10
of LONG_PROMPT; deepseek_v2 int8, position 0 of PROMPT, its logits 0.17 apart)."""


@dataclass(frozen=True)
class Routed:
    """One router call of a pass: its input x [T, H] and the ids it chose [T, K]."""

    router: Router
    x: torch.Tensor
    ids: torch.Tensor

    def choice(self) -> torch.Tensor:
        """The scores [T, E] `route` ranks (before any group limit): softmax or sigmoid of the
        fp32 logits, plus noaux_tc's steering bias."""
        c = self.router.config
        logits = F.linear(self.x.float(), self.router.weight.float())
        scores = logits.softmax(-1) if c.scoring == "softmax" else logits.sigmoid()
        return scores + self.router.e_score_correction_bias.float() if c.has_bias else scores


@pytest.fixture(scope="module")
def llm_with(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], LLM]:
    """`llm_with(family, format)`: an fp32 CPU `LLM` whose routed experts are `cpu` in that
    packed format (fp8: from an FP8 checkpoint of 32-wide blocks, a group the kernels read)."""

    def get(family: str, fmt: str) -> LLM:
        rules = tmp_path_factory.mktemp("rules") / f"{family}_{fmt}.yaml"
        rules.write_text(Path(shipped_rules_path(family)).read_text().replace(
            "kwargs: {experts: auto}", f"kwargs: {{experts: cpu, weight_format: {fmt}}}"))
        path = tiny_dir(family, fp8=True, fp8_block=32) if fmt == "fp8" else tiny_dir(family)
        return LLM(path, device="cpu", dtype="float32", rules=rules, progress=False,
                   max_seq_len=64)

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


@contextmanager
def _routing(model: torch.nn.Module) -> Iterator[list[Routed]]:
    """Every router call of `model` meanwhile, in order (one per MoE layer and pass)."""
    seen: list[Routed] = []

    def hook(router: torch.nn.Module, args: tuple[torch.Tensor, ...],
             out: tuple[torch.Tensor, torch.Tensor]) -> None:
        assert isinstance(router, Router)
        seen.append(Routed(router, args[0].detach().clone(), out[0].clone()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _prefill(runner: ModelRunner, prompt: list[int], path: str) -> tuple[torch.Tensor,
                                                                          list[Routed]]:
    """The prompt's prefill logits [T, V] and its routing, its experts on the CPU (`path`
    "cpu") or streamed through the packed kernels ("kernel") or the torch unpack ("unpack")."""
    overlap = runner.overlap
    assert overlap is not None
    runner.lengths[0] = 0
    with _routing(runner.model) as routed:
        if path == "cpu":
            return runner.prefill_logits(0, prompt), routed
        streamer = overlap.make_streamer()
        streamer.packed_kernel = path == "kernel"
        with overlap.streamed(len(prompt)):
            return runner.prefill_logits(0, prompt), routed


def _routed_alike(got: list[Routed], want: list[Routed]) -> torch.Tensor:
    """Positions [T] bool where every MoE layer chose the same experts on both paths; each
    other position must be a near tie (ROUTER_TIE) of `want`'s scores, and at most MAX_FLIPS."""
    assert len(got) == len(want) > 0
    alike = torch.ones(got[0].ids.shape[0], dtype=torch.bool)
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        choice = b.choice()
        for t in (a.ids.sort(-1).values != b.ids.sort(-1).values).any(-1).nonzero().flatten():
            only_a = sorted(set(a.ids[t].tolist()) - set(b.ids[t].tolist()))
            only_b = sorted(set(b.ids[t].tolist()) - set(a.ids[t].tolist()))
            gap = (choice[t, only_b].max() - choice[t, only_a].min()).item()
            assert abs(gap) <= ROUTER_TIE, \
                f"MoE layer {layer} position {t}: experts {only_a} for {only_b}, gap {gap:.3g}"
            alike[t] = False
    assert (~alike).sum() <= MAX_FLIPS, f"routes differ at {(~alike).nonzero().flatten()}"
    return alike


@pytest.mark.parametrize(("family", "fmt", "prompt"), [
    ("qwen3_moe", "int8", PROMPT), ("qwen3_moe", "int4", PROMPT),  # GQA
    ("qwen3_moe", "fp8", PROMPT),
    ("deepseek_v2", "int8", PROMPT), ("deepseek_v2", "int4", PROMPT),  # MLA
    ("deepseek_v3", "int4", LONG_PROMPT), ("deepseek_v3", "fp8", PROMPT),
], ids=lambda v: f"{len(v)}_tokens" if isinstance(v, list) else str(v))
def test_prefill_through_the_packed_kernels_equals_the_cpu_experts(
        llm_with: Callable[[str, str], LLM], kernel_calls: list[str], family: str,
        fmt: str, prompt: list[int]) -> None:
    llm = llm_with(family, fmt)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64,
                         EngineConfig(gpu_expert_bytes=0, prefill_experts="cpu"))
    try:
        assert runner.overlap is not None
        layers = len(runner.overlap.cpu)
        assert {m.weight_format for m in runner.overlap.cpu} == {fmt}
        cpu, cpu_routes = _prefill(runner, prompt, "cpu")
        assert kernel_calls == []
        assert not runner.overlap.make_streamer().packed_kernel  # the CPU device: unpack
        gpu, gpu_routes = _prefill(runner, prompt, "kernel")
        assert kernel_calls == [fmt] * layers  # every layer's experts, one NUMA group each
        unpacked, unpacked_routes = _prefill(runner, prompt, "unpack")  # torch: no kernel call
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()
    assert kernel_calls == [fmt] * layers
    scale = cpu.abs().max().item()
    alike = _routed_alike(gpu_routes, cpu_routes)
    delta = (gpu - cpu)[alike].abs().max().item()
    assert delta <= FORMAT_RTOL[fmt] * scale, f"{family} {fmt}: |Δlogits| {delta:.3g}"
    alike = _routed_alike(gpu_routes, unpacked_routes)
    delta = (gpu - unpacked)[alike].abs().max().item()
    assert delta <= KERNEL_RTOL * scale, f"{family} {fmt}: |Δlogits| {delta:.3g} to the unpack"
    assert bool((gpu.argmax(-1) == cpu.argmax(-1))[alike].all())
