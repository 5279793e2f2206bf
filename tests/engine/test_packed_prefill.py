"""Whole-model prefill through the packed expert kernels (kernels/packed_moe.py) on int8, int4 and
fp8 experts against the CPU experts' prefill. Without a GPU the "GPU" is the CPU device and the
kernels run under Triton's interpreter (tests/conftest.py); there `unpack_reason` refuses the
CPU device, so the streamer would unpack to bf16: these tests set its `packed_kernel` and check
that every layer's streamed experts went through `packed_moe` on their packed bytes.

Two paths whose experts differ by their format's legitimate rounding can still route a token
differently where a router's k-th and (k+1)-th scores nearly tie, and a flipped expert moves that
position's logits by far more than the rounding. So the CPU path's routing (ids and weights of
every MoE layer) is forced onto the kernel and unpack paths, and every position's logits are
compared; the scores each path's routers computed on their own inputs are checked apart
(ROUTER_ATOL), which bounds where an unforced route could have flipped."""

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
"""Eleven tokens, the last of which deepseek_v3 int4 would route differently on the kernels and
the CPU experts unforced (ROUTER_ATOL); 13 of 84 random 16-token prompts flipped 1-3 positions
of its last MoE layer."""
FORMAT_RTOL = {"int8": 0.01, "int4": 0.03, "fp8": 2**-8}
"""|Δlogits| / max |logit| of the kernels' prefill against the CPU experts', at every position,
the CPU's routing forced. Both read the same packed weights, but the CPU's int kernels also
quantize each row's activations (per group) while the kernels dequantize the weights alone to
bf16: measured 0.0034-0.0042 (int8) and 0.005-0.016 (int4; the most at deepseek_v3's first
position) of the baby models' logits of ~11-14 (qwen3_moe, deepseek_v2, deepseek_v3), as far as
the torch unpack path of the same bytes is from the CPU's (bf16 experts: 3e-7). fp8 quantizes no
activation on either side: bf16 x times the e4m3 code (exact in bf16) with the block scale in
fp32 is the same product on both, leaving the fp32 sums' order and a tie of the intermediate's
bf16 rounding, so one bf16 step (2^-8) of the largest logit bounds them: measured 3e-5
(qwen3_moe) and 3e-7 (deepseek_v3). The last row's weakest pair lost in any one MoE layer moves
that position by 0.079-0.17 (int8 and int4 of deepseek_v2 and deepseek_v3; qwen3_moe's weakest
weight there is 0.009, within rounding; its strongest lost moves it by 0.24)."""
KERNEL_RTOL = 0.006
"""|Δlogits| / max |logit| of the kernels against the torch unpack path of the same bytes, the
CPU's routing forced on both (the same dequantized weights, but the unpack rounds fp8's
code x scale to bf16): only the bf16 rounding of x and of the intermediate differs (the
interpreter truncates, torch rounds to nearest); measured <= 0.0038 (deepseek_v3 int4,
LONG_PROMPT)."""
ROUTER_ATOL = 0.015
"""Largest |Δ| between the choice scores (`Routed.choice`) a MoE layer's router computes on the
forced kernel path's input and on the CPU path's, so an unforced route could flip only at a near
tie of the CPU's scores (two experts < 2x this apart, or two groups' top-2 sums < 4x). Measured
up to 0.0088 (deepseek_v2 int4; deepseek_v3 int4 0.0084, qwen3_moe 0.002); the bound leaves room
for a change in the CPU kernels' activation rounding. deepseek_v3 int4,
LONG_PROMPT: the CPU's activation quantization moves its first MoE layer's output by up to 0.07
(of ~4) and the second layer's router input by 0.04 (of ~3.3). At position 10 experts 0 and 4
scored 0.5806 / 0.5771 on the kernel path, 0.5802 / 0.5817 on the CPU's: a gap of 0.0035 turned
to -0.0015, so unforced the kernels take expert 0, the CPU expert 4, and that position's logits
differ by 2.04 (0.16 of the largest); forced alike, by 0.10."""


@dataclass(frozen=True)
class Routed:
    """One router call of a pass: its input x [T, H] and what the router chose itself on it,
    ids [T, K] and weights [T, K] (before any forcing)."""

    router: Router
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor

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
def _runner(llm: LLM) -> Iterator[ModelRunner]:
    """A one-slot runner over `llm` whose routed experts overlap (CPU experts, streamable)."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64,
                         EngineConfig(gpu_expert_bytes=0, prefill_experts="cpu"))
    assert runner.overlap is not None
    try:
        yield runner
    finally:
        runner.overlap.detach()


@contextmanager
def _routing(model: torch.nn.Module, forced: list[Routed] | None) -> Iterator[list[Routed]]:
    """Every router call of `model` meanwhile, in order (one per MoE layer and pass); with
    `forced`, each call's output is replaced by the ids and weights of forced's same call."""
    seen: list[Routed] = []

    def hook(router: torch.nn.Module, args: tuple[torch.Tensor, ...],
             out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        assert isinstance(router, Router)
        seen.append(Routed(router, args[0].detach().clone(), out[0].clone(), out[1].clone()))
        if forced is None:
            return None
        assert len(seen) <= len(forced), f"router call {len(seen)} of {len(forced)} recorded"
        want = forced[len(seen) - 1]
        assert want.router is router and want.ids.shape == out[0].shape, \
            f"router call {len(seen)} is not the recorded pass's"
        return want.ids.clone(), want.weights.clone()

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _prefill(runner: ModelRunner, prompt: list[int], path: str,
             forced: list[Routed] | None = None) -> tuple[torch.Tensor, list[Routed]]:
    """The prompt's prefill logits [T, V] and its routing, its experts on the CPU (`path`
    "cpu") or streamed through the packed kernels ("kernel") or the torch unpack ("unpack");
    with `forced` (a pass's routing), every MoE layer takes that pass's ids and weights."""
    overlap = runner.overlap
    assert overlap is not None
    runner.lengths[0] = 0
    with _routing(runner.model, forced) as routed:
        if path == "cpu":
            return runner.prefill_logits(0, prompt), routed
        streamer = overlap.make_streamer()
        streamer.packed_kernel = path == "kernel"
        with overlap.streamed(len(prompt)):
            return runner.prefill_logits(0, prompt), routed


def _assert_close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    """|got - want| <= bound at every position of the logits [T, V]; the message names the
    worst position."""
    per_position = (got - want).abs().amax(-1)  # [T]
    worst = int(per_position.argmax())
    assert per_position[worst] <= bound, \
        f"|Δlogits| {per_position[worst]:.3g} > {bound:.3g} to {what} at position {worst}"


def _assert_scores_close(got: list[Routed], want: list[Routed]) -> None:
    """Each MoE layer's choice scores on `got`'s inputs within ROUTER_ATOL of `want`'s."""
    assert len(got) == len(want) > 0
    for layer, (a, b) in enumerate(zip(got, want, strict=True)):
        delta = (a.choice() - b.choice()).abs().max().item()
        assert delta <= ROUTER_ATOL, f"MoE layer {layer}: router scores {delta:.3g} apart"


@pytest.mark.parametrize(("family", "fmt", "prompt"), [
    ("qwen3_moe", "int8", PROMPT), ("qwen3_moe", "int4", PROMPT),  # GQA
    ("qwen3_moe", "fp8", PROMPT),
    ("deepseek_v2", "int8", PROMPT), ("deepseek_v2", "int4", PROMPT),  # MLA
    ("deepseek_v3", "int4", LONG_PROMPT), ("deepseek_v3", "fp8", PROMPT),
], ids=lambda v: f"{len(v)}_tokens" if isinstance(v, list) else str(v))
def test_prefill_through_the_packed_kernels_equals_the_cpu_experts(
        llm_with: Callable[[str, str], LLM], kernel_calls: list[str], family: str,
        fmt: str, prompt: list[int]) -> None:
    with _runner(llm_with(family, fmt)) as runner:
        assert runner.overlap is not None
        layers = len(runner.overlap.cpu)
        assert {m.weight_format for m in runner.overlap.cpu} == {fmt}
        cpu, cpu_routes = _prefill(runner, prompt, "cpu")
        assert kernel_calls == []
        assert not runner.overlap.make_streamer().packed_kernel  # the CPU device: unpack
        gpu, gpu_routes = _prefill(runner, prompt, "kernel", cpu_routes)
        assert kernel_calls == [fmt] * layers  # every layer's experts, one NUMA group each
        unpacked, _ = _prefill(runner, prompt, "unpack", cpu_routes)  # torch: no kernel call
    assert kernel_calls == [fmt] * layers
    _assert_scores_close(gpu_routes, cpu_routes)
    scale = cpu.abs().max().item()
    _assert_close(gpu, cpu, FORMAT_RTOL[fmt] * scale, f"the CPU experts ({family} {fmt})")
    _assert_close(gpu, unpacked, KERNEL_RTOL * scale, f"the unpack path ({family} {fmt})")
    assert int(gpu[-1].argmax()) == int(cpu[-1].argmax())  # the next token


def test_a_lost_pair_of_the_last_row_fails_the_comparison(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial-tile bug that drops the last row's weakest expert pair in every MoE layer: with
    the routing forced alike nothing excuses that position, and its logits move by 0.13 of the
    largest, over four times int4's bound; the other rows stay within it."""
    real = layer_stream.packed_moe

    def lossy(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *args: object,
              **options: object) -> torch.Tensor:
        weights = weights.clone()
        weights[-1, -1] = 0  # [T, K], best first
        return real(x, ids, weights, *args, **options)  # type: ignore[arg-type]

    with _runner(llm_with("deepseek_v2", "int4")) as runner:
        cpu, cpu_routes = _prefill(runner, PROMPT, "cpu")
        monkeypatch.setattr(layer_stream, "packed_moe", lossy)
        gpu, _ = _prefill(runner, PROMPT, "kernel", cpu_routes)
    bound = FORMAT_RTOL["int4"] * cpu.abs().max().item()
    _assert_close(gpu[:-1], cpu[:-1], bound, "the CPU experts")
    with pytest.raises(AssertionError, match=f"to the CPU experts at position {len(PROMPT) - 1}"):
        _assert_close(gpu, cpu, bound, "the CPU experts")
