"""The pieces of the whole-model prefill tests through the packed expert kernels
(kernels/packed_moe.py) against the CPU experts' prefill: on the CPU device under Triton's
interpreter (test_packed_prefill.py) and compiled for a GPU (test_packed_prefill_device.py).

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
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement import layer_stream
from hetmoe.inject.rules import shipped_rules_path
from hetmoe.ops.router import Router

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


CASES = [
    ("qwen3_moe", "int8", PROMPT), ("qwen3_moe", "int4", PROMPT),  # GQA
    ("qwen3_moe", "fp8", PROMPT),
    ("deepseek_v2", "int8", PROMPT), ("deepseek_v2", "int4", PROMPT),  # MLA
    ("deepseek_v3", "int4", LONG_PROMPT), ("deepseek_v3", "fp8", PROMPT),
]
"""(family, format, prompt) of the comparisons, on either device."""


def case_id(value: object) -> str:
    """A case's part in its test id: a prompt by its length."""
    return f"{len(value)}_tokens" if isinstance(value, list) else str(value)


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


def llm_factory(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
                device: str) -> Callable[[str, str], LLM]:
    """`get(family, format)`: an fp32 `LLM` on `device` whose routed experts are `cpu` in that
    packed format (fp8: from an FP8 checkpoint of 32-wide blocks, a group the kernels read). On
    a GPU its own runner keeps every expert on the CPU (no resident experts)."""
    options: dict[str, Any] = {"gpu_expert_bytes": 0} if device == "cuda" else {}

    def get(family: str, fmt: str) -> LLM:
        rules = tmp_path_factory.mktemp("rules") / f"{family}_{fmt}.yaml"
        rules.write_text(Path(shipped_rules_path(family)).read_text().replace(
            "kwargs: {experts: auto}", f"kwargs: {{experts: cpu, weight_format: {fmt}}}"))
        path = tiny_dir(family, fp8=True, fp8_block=32) if fmt == "fp8" else tiny_dir(family)
        return LLM(path, device=device, dtype="float32", rules=rules, progress=False,
                   max_seq_len=64, **options)

    return get


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The format of every `packed_moe` call the streamer makes from now to the test's end."""
    calls: list[str] = []
    real = layer_stream.packed_moe

    def counted(*args: object, **options: object) -> torch.Tensor:
        calls.append(str(args[5]))  # x, ids, weights, packed, part, fmt, ...
        return real(*args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(layer_stream, "packed_moe", counted)
    return calls


@contextmanager
def one_slot_runner(llm: LLM) -> Iterator[ModelRunner]:
    """A one-slot runner over `llm` whose routed experts overlap (CPU experts, streamable)."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, 64,
                         EngineConfig(gpu_expert_bytes=0, prefill_experts="cpu"))
    assert runner.overlap is not None
    try:
        yield runner
    finally:
        runner.overlap.detach()


@contextmanager
def routing(model: torch.nn.Module, forced: list[Routed] | None) -> Iterator[list[Routed]]:
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


def prefill(runner: ModelRunner, prompt: list[int], path: str,
             forced: list[Routed] | None = None) -> tuple[torch.Tensor, list[Routed]]:
    """The prompt's prefill logits [T, V] and its routing, its experts on the CPU (`path`
    "cpu") or streamed through the packed kernels ("kernel") or the torch unpack ("unpack");
    with `forced` (a pass's routing), every MoE layer takes that pass's ids and weights."""
    overlap = runner.overlap
    assert overlap is not None
    runner.lengths[0] = 0
    with routing(runner.model, forced) as routed:
        if path == "cpu":
            return runner.prefill_logits(0, prompt), routed
        streamer = overlap.make_streamer()
        streamer.packed_kernel = path == "kernel"
        with overlap.streamed(len(prompt)):
            return runner.prefill_logits(0, prompt), routed


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    """|got - want| <= bound at every position of the logits [T, V]; the message names the
    worst position."""
    per_position = (got - want).abs().amax(-1)  # [T]
    worst = int(per_position.argmax())
    assert per_position[worst] <= bound, \
        f"|Δlogits| {per_position[worst]:.3g} > {bound:.3g} to {what} at position {worst}"


def score_gaps(got: list[Routed], want: list[Routed]) -> list[float]:
    """Per MoE layer, the largest |Δ| between its choice scores on `got`'s inputs and on
    `want`'s."""
    assert len(got) == len(want) > 0
    return [(a.choice() - b.choice()).abs().max().item() for a, b in zip(got, want, strict=True)]


def compare_prefills(runner: ModelRunner, calls: list[str], family: str, fmt: str,
                     prompt: list[int], streamer_packs: bool) -> None:
    """The prompt's prefill on the CPU experts, then through the packed kernels and the torch
    unpack with the CPU's routing forced: one kernel call per MoE layer and NUMA group (`calls`
    from `count_kernel_calls`), the kernel path's router scores within ROUTER_ATOL, its logits
    within FORMAT_RTOL of the CPU's and KERNEL_RTOL of the unpack's at every position, the same
    next token. `streamer_packs`: the streamer's own choice before a pass sets it (False on the
    CPU device, which `unpack_reason` refuses). Prints the measured |Δlogits| / max |logit| of
    each comparison and the largest router score difference."""
    overlap = runner.overlap
    assert overlap is not None
    assert {m.weight_format for m in overlap.cpu} == {fmt}
    want_calls = [fmt] * sum(m.num_groups for m in overlap.cpu)
    cpu, cpu_routes = prefill(runner, prompt, "cpu")
    assert calls == []
    assert overlap.make_streamer().packed_kernel == streamer_packs
    gpu, gpu_routes = prefill(runner, prompt, "kernel", cpu_routes)
    assert calls == want_calls  # every layer's experts, each NUMA group's slice
    unpacked, _ = prefill(runner, prompt, "unpack", cpu_routes)  # torch: no kernel call
    assert calls == want_calls
    scale, gaps = cpu.abs().max().item(), score_gaps(gpu_routes, cpu_routes)
    measured = {"cpu_experts": (gpu - cpu).abs().max().item() / scale,
                "unpack": (gpu - unpacked).abs().max().item() / scale, "router": max(gaps)}
    print(f"{family} {fmt}, {len(prompt)} tokens: |Δlogits| / max |logit| to the CPU experts "
          f"{measured['cpu_experts']:.3g} (bound {FORMAT_RTOL[fmt]}), to the unpack "
          f"{measured['unpack']:.3g} (bound {KERNEL_RTOL}); router scores up to "
          f"{measured['router']:.3g} apart (bound {ROUTER_ATOL})")
    worst = gaps.index(max(gaps))
    assert gaps[worst] <= ROUTER_ATOL, f"MoE layer {worst}: router scores {gaps[worst]:.3g} apart"
    assert_close(gpu, cpu, FORMAT_RTOL[fmt] * scale, f"the CPU experts ({family} {fmt})")
    assert_close(gpu, unpacked, KERNEL_RTOL * scale, f"the unpack path ({family} {fmt})")
    assert int(gpu[-1].argmax()) == int(cpu[-1].argmax())  # the next token
