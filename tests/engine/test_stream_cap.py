"""A streamer whose staging holds k experts of a layer (engine/placement/staging_plan.py): a pass
copies at most k misses per layer, the CPU computes the others at the same time, and the
layer's output equals the uncapped pass (the "GPU" is the CPU device here); the prefill planner
never asks for more than k and says so."""

from __future__ import annotations

import pytest
import torch

from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.placement.expert_split import PrefillTuner, SplitCosts, plan_gpu_experts
from hetmoe.engine.placement.layer_stream import LayerStreamer
from hetmoe.experts.cpu_moe import CpuMoE, PendingCall

CPU = torch.device("cpu")
COSTS = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6, gpu_token=0.07e-6,
                   gpu_fixed=70e-6, cpu_call=100e-6, split_fixed=100e-6, split_token=0.16e-6)
"""The Qwen3-30B-A3B int8 costs of tests/engine/test_expert_split.py."""

ATOL = 4e-3
"""|Δ| of a layer's bf16 output (|out| up to 0.32: an ulp is 2e-3): the streamed experts run the
bf16 unpack + GEMM, the CPU's the int8 kernel; a pair lost or counted twice moves an output by
up to 0.23 (0.025 on average) at these scales."""


def _layer(seed: int) -> CpuMoE:
    g = torch.Generator().manual_seed(seed)
    moe = CpuMoE(8, 64, 96, "int8")
    gate, up = (torch.randn(8, 96, 64, generator=g) * 0.1 for _ in range(2))
    moe.load(gate, up, torch.randn(8, 64, 96, generator=g) * 0.1)
    return moe


def _run(streamer: LayerStreamer, i: int, x: torch.Tensor, ids: torch.Tensor,
         weights: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Layer i's output [T, H] and the expert ids of every CPU call the pass made."""
    moe, seen = streamer.cpu[i], []
    original = moe.submit

    def counted(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor | None = None) -> PendingCall:
        seen.append(ids.clone())
        return original(x, ids, weights, out)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "submit", counted)
        return streamer.start(i, x, ids, weights)(), seen


def test_a_capped_streamer_streams_k_misses_and_equals_the_uncapped_pass() -> None:
    cpu = [_layer(0), _layer(1)]
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(24, 64, generator=g) * 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(24)])  # [T, 2]
    weights = torch.softmax(torch.randn(24, 2, generator=g), -1)
    whole, capped = LayerStreamer(cpu, CPU), LayerStreamer(cpu, CPU, cap=3)
    per_expert = sum(p.expert_bytes for p in cpu[0].packed_groups())
    assert capped.staging[0].numel() == 3 * per_expert
    whole.begin(24, 2)
    capped.begin(24, 2)  # None: as many as the staging holds
    assert capped.gpu_experts == 3
    assert [p.streamed for p in capped.passes] == [(0, 1, 2)] * 2
    assert all(p.cpu for p in capped.passes)
    assert capped.copied_bytes == 2 * 3 * per_expert  # layers 0 and 1 queued, 3 experts each
    assert capped.bytes_per_pass() == 2 * 3 * per_expert
    for i in range(2):
        expected, none = _run(whole, i, x, ids, weights)
        got, calls = _run(capped, i, x, ids, weights)
        assert none == [] and len(calls) == 1  # one CPU call, for experts 3..7 only
        assert set(calls[0].unique().tolist()) <= {3, 4, 5, 6, 7, -1}
        assert torch.equal(calls[0] >= 0, ids >= 3)
        reference = cpu[i](x.float(), ids, weights)  # every pair on the CPU
        torch.testing.assert_close(got.float(), expected.float(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got.float(), reference, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match=r"gpu_experts must be in \[1, 3\], got 4 \(the staging "
                       r"buffers hold 3 of a layer's 8 experts\)"):
        capped.begin(24, 2, 4)


def test_the_planner_never_streams_more_than_the_cap() -> None:
    planner = PrefillPlanner(128, 8, 4, COSTS, refusal=lambda: "", cap=lambda: 40)
    assert planner.stream_cap is None  # asked once the GPU is known to stream
    assert planner.gpu_experts(16384, "gpu") == 40 and planner.stream_cap == 40
    assert (planner.misses, planner.most) == (128, 40)
    assert planner.gpu_experts(16384, "split") == plan_gpu_experts(16384, 8, 128, COSTS, 1, 40)
    assert planner.gpu_experts(16384, "auto") == PrefillTuner().choose(16384, 8, 128, COSTS,
                                                                         cap=40) == 40
    assert planner.describe(40) == "split (40 of 128 experts on the GPU) (all the staging holds)"
    assert planner.describe(128 - 1) == "split (127 of 128 experts on the GPU)"
    uncapped = PrefillPlanner(128, 8, 4, COSTS, refusal=lambda: "", cap=lambda: 500)
    assert uncapped.gpu_experts(16384, "gpu") == 128 and uncapped.most == 128
