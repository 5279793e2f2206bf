"""Whole-model prefill through the packed expert kernels (kernels/packed_moe.py) on int8, int4 and
fp8 experts against the CPU experts' prefill (packed_prefill_checks.py: the CPU's routing forced
on the kernel and unpack paths). Without a GPU the "GPU" is the CPU device and the kernels run
under Triton's interpreter (tests/conftest.py); there `unpack_reason` refuses the CPU device, so
the streamer would unpack to bf16: these tests set its `packed_kernel` and check that every
layer's streamed experts went through `packed_moe` on their packed bytes. A GPU host runs the
same comparisons with the kernels compiled for it: test_packed_prefill_device.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from packed_prefill_checks import (
    CASES,
    FORMAT_RTOL,
    PROMPT,
    assert_close,
    case_id,
    compare_prefills,
    count_kernel_calls,
    llm_factory,
    one_slot_runner,
    prefill,
)

from hetmoe import LLM
from hetmoe.engine.placement import layer_stream

pytest.importorskip("triton", reason="the packed kernels need Triton (pip install triton)")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host compiles the "
                                "kernels for CUDA tensors, not the CPU device's (no interpreter)")


@pytest.fixture(scope="module")
def llm_with(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], LLM]:
    """`llm_with(family, format)`: an fp32 CPU-device `LLM`, its routed experts `cpu` in that
    packed format."""
    return llm_factory(tiny_dir, tmp_path_factory, "cpu")


@pytest.mark.parametrize(("family", "fmt", "prompt"), CASES, ids=case_id)
def test_prefill_through_the_packed_kernels_equals_the_cpu_experts(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch, family: str,
        fmt: str, prompt: list[int]) -> None:
    calls = count_kernel_calls(monkeypatch)
    with one_slot_runner(llm_with(family, fmt)) as runner:
        compare_prefills(runner, calls, family, fmt, prompt, streamer_packs=False)


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

    with one_slot_runner(llm_with("deepseek_v2", "int4")) as runner:
        cpu, cpu_routes = prefill(runner, PROMPT, "cpu")
        monkeypatch.setattr(layer_stream, "packed_moe", lossy)
        gpu, _ = prefill(runner, PROMPT, "kernel", cpu_routes)
    bound = FORMAT_RTOL["int4"] * cpu.abs().max().item()
    assert_close(gpu[:-1], cpu[:-1], bound, "the CPU experts")
    with pytest.raises(AssertionError, match=f"to the CPU experts at position {len(PROMPT) - 1}"):
        assert_close(gpu, cpu, bound, "the CPU experts")
