"""`LayerStreamer` (GPU prefill's expert compute on the packed bytes copied to the GPU, and on
resident experts' slots) against the float64 oracle and the CPU backend: device tests
(`pytest -m device` on a GPU host; tests/engine/test_stream_placement.py runs it on the CPU)."""

from __future__ import annotations

import pytest
import torch
from moe_oracle import make_experts, rel_error

from hetmoe.engine.placement.layer_stream import LayerStreamer
from hetmoe.engine.placement.slots import LayerSlots
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.gpu_view import gpu_view

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 33, 700])
@pytest.mark.parametrize(("gpu_experts", "resident"), [
    (16, None), (5, None),  # every expert streamed; a split of the first 5
    (16, [tuple(range(16)), (0, 3, 4, 9), ()]),  # resident: a whole layer, some, none
    (3, [(1, 2), (0, 3, 4, 9), (15,)]),  # 3 misses streamed, the CPU computes the others
])
def test_streamed_layers_equal_the_cpu_experts(fmt: str, tokens: int, gpu_experts: int,
                                               resident: list[tuple[int, ...]] | None) -> None:
    """Every expert streamed (16), or split: the first misses copied and run on the GPU while
    the CPU runs the rest at once; resident experts run from their slots, never copied."""
    layers = [CpuMoE(16, 256, 384, fmt) for _ in range(3)]
    weights = [make_experts(16, 256, 384, seed=s) for s in range(3)]
    for moe, w in zip(layers, weights, strict=True):
        moe.load(w.gate, w.up, w.down)
    device = torch.device("cuda")
    slots = None if resident is None else [LayerSlots(m, r, device)
                                           for m, r in zip(layers, resident, strict=True)]
    expert_bytes = sum(p.expert_bytes for p in layers[0].packed_groups())
    misses = [16 - len(r) for r in resident or [()] * 3]
    streamer = LayerStreamer(layers, device)
    for _ in range(2):  # two passes: the staging buffers are reused across passes
        streamer.begin(tokens, 4, gpu_experts, slots)
        assert streamer.bytes_per_pass() == sum(misses) * expert_bytes
        for i, (moe, w) in enumerate(zip(layers, weights, strict=True)):
            g = torch.Generator().manual_seed(100 * i + tokens)
            x = torch.randn(tokens, 256, generator=g)
            ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
            gate = torch.rand(tokens, 4, generator=g)
            out = streamer.start(i, x.cuda(), ids.cuda(), gate.cuda())().cpu()
            ref = w.reference(x, ids, gate)
            cpu = moe.forward(x, ids, gate)
            if fmt == "int4":  # asymmetric least-squares int4: as close as the CPU kernels
                assert rel_error(out, ref) <= 1.05 * rel_error(cpu, ref) + 1e-3
                assert rel_error(out, cpu.double()) < 0.06
            else:
                assert rel_error(out, ref) < (0.01 if fmt == "bf16" else 0.03)
                assert rel_error(out, cpu.double()) < 0.03
        torch.cuda.synchronize()
        assert streamer.copied_bytes == sum(min(gpu_experts, m) for m in misses) * expert_bytes


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_capped_streamer_streams_at_most_its_cap(fmt: str) -> None:
    """Staging of 4 experts per layer (engine/placement/staging_plan.py): buffers of 4 experts,
    at most 4 misses streamed per layer, the CPU computing the other 12 at once, the output as
    close to the oracle as the uncapped pass's."""
    layers = [CpuMoE(16, 256, 384, fmt) for _ in range(3)]
    weights = [make_experts(16, 256, 384, seed=s) for s in range(3)]
    for moe, w in zip(layers, weights, strict=True):
        moe.load(w.gate, w.up, w.down)
    device = torch.device("cuda")
    expert_bytes = sum(p.expert_bytes for p in layers[0].packed_groups())
    streamer = LayerStreamer(layers, device, cap=4)
    assert [b.numel() for b in streamer.staging] == [4 * expert_bytes] * 2
    streamer.begin(64, 4)  # None: as many as the staging holds
    assert streamer.gpu_experts == 4 and streamer.bytes_per_pass() == 3 * 4 * expert_bytes
    for i, (moe, w) in enumerate(zip(layers, weights, strict=True)):
        g = torch.Generator().manual_seed(7 + i)
        x = torch.randn(64, 256, generator=g)
        ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(64)])
        gate = torch.rand(64, 4, generator=g)
        out = streamer.start(i, x.cuda(), ids.cuda(), gate.cuda())().cpu()
        ref, cpu = w.reference(x, ids, gate), moe.forward(x, ids, gate)
        assert rel_error(out, ref) <= 1.05 * rel_error(cpu, ref) + 1e-3
        assert rel_error(out, cpu.double()) < (0.06 if fmt == "int4" else 0.03)
    torch.cuda.synchronize()
    assert streamer.copied_bytes == 3 * 4 * expert_bytes
    with pytest.raises(ValueError, match=r"gpu_experts must be in \[1, 4\], got 5 \(the "
                       r"staging buffers hold 4 of a layer's 16 experts\)"):
        streamer.begin(64, 4, 5)


def test_bad_gpu_expert_counts_are_refused() -> None:
    moe = CpuMoE(16, 256, 384, "int8")
    w = make_experts(16, 256, 384, seed=0)
    moe.load(w.gate, w.up, w.down)
    streamer = LayerStreamer([moe, moe], torch.device("cuda"))
    for bad in (0, 17):
        with pytest.raises(ValueError, match=r"gpu_experts must be in \[1, 16\], got"):
            streamer.begin(8, 4, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_view_reads_pinned_host_memory_in_place(dtype: torch.dtype) -> None:
    host = torch.zeros(5, 7, dtype=dtype, pin_memory=True)
    view = gpu_view(host, torch.device("cuda"))
    assert view.device.type == "cuda" and view.dtype == dtype and view.shape == (5, 7)
    host.copy_(torch.arange(35, dtype=torch.float32).reshape(5, 7))
    torch.testing.assert_close(view.cpu(), host)  # the host's later writes are what it reads
    with pytest.raises(ValueError, match="pinned, contiguous"):
        gpu_view(torch.zeros(3), torch.device("cuda"))
    with pytest.raises(ValueError, match="not bf16 or fp32"):
        gpu_view(torch.zeros(3, dtype=torch.int64, pin_memory=True), torch.device("cuda"))
