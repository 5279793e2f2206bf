"""Whole-model prefill through the packed expert kernels compiled for the GPU against the CPU
experts' prefill on the host: device tests (`pytest -m device` on a GPU host). The comparisons of
test_packed_prefill.py (packed_prefill_checks.py: the CPU's routing forced on the kernel and
unpack paths, every position's logits), with the model on CUDA and the streamer choosing the
packed kernels itself (`unpack_reason` empty: no override of `packed_kernel`). Prints each
case's measured differences beside their bounds (`-s` shows them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from packed_prefill_checks import (
    CASES,
    case_id,
    compare_prefills,
    count_kernel_calls,
    llm_factory,
    one_slot_runner,
)

from hetmoe import LLM
from hetmoe.kernels.prefill_path import unpack_reason

pytest.importorskip("triton", reason="the packed kernels need Triton (pip install triton)")
pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


@pytest.fixture(scope="module")
def llm_with(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], LLM]:
    """`llm_with(family, format)`: an fp32 `LLM` on the GPU, its routed experts `cpu` in that
    packed format (none resident on the GPU)."""
    return llm_factory(tiny_dir, tmp_path_factory, "cuda")


@pytest.mark.parametrize(("family", "fmt", "prompt"), CASES, ids=case_id)
def test_prefill_through_the_compiled_kernels_equals_the_cpu_experts(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch, family: str,
        fmt: str, prompt: list[int]) -> None:
    """The bounds are the CPU test's (FORMAT_RTOL, KERNEL_RTOL, ROUTER_ATOL), which hold here:
    - CPU experts: a CPU expert runs its AMX kernels only from `amx_min_tokens` rows (32 for
      int8 and int4, 8 for fp8: `AMX_MIN_TOKENS`); these prompts give each expert fewer, so the
      host's AMX is never used and its experts run the AVX-512 int kernels, activations
      quantized per group, as on a host without AMX (asserted below: a longer prompt would bring
      in the AMX kernels, and FORMAT_RTOL would have to be measured there again: int4's
      opt-in int8-tile kernel, HETMOE_AMX_INT4=i8, requantizes each row to int8 with one
      scale);
    - the unpack: compiled kernels round x and the intermediate to bf16 to nearest, as torch
      does, where the interpreter truncated; left are the fp32 sums' order and tensor-core
      accumulation, within the interpreter's measured difference."""
    calls = count_kernel_calls(monkeypatch)
    with one_slot_runner(llm_with(family, fmt)) as runner:
        assert runner.overlap is not None
        why = unpack_reason(runner.overlap.device, fmt)
        assert not why, f"GPU prefill would unpack {fmt} experts to bf16: {why}"
        rows = min(m.amx_min_tokens for m in runner.overlap.cpu)
        assert len(prompt) < rows, \
            f"{len(prompt)} tokens: CPU experts of {rows}+ rows run AMX kernels (see the bounds)"
        compare_prefills(runner, calls, family, fmt, prompt, streamer_packs=True)
