"""`LayerStreamer` (GPU prefill's expert compute on the packed bytes copied to the GPU) against
the float64 oracle and the CPU backend: device tests (`pytest -m device` on a GPU host)."""

from __future__ import annotations

import pytest
import torch
from moe_oracle import make_experts, rel_error

from hetmoe.engine.expert_split import SplitCosts, plan_split
from hetmoe.engine.layer_stream import LayerStreamer
from hetmoe.experts.cpu_moe import CpuMoE

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 33, 700])
def test_streamed_layers_equal_the_cpu_experts(fmt: str, tokens: int) -> None:
    layers = [CpuMoE(16, 256, 384, fmt) for _ in range(3)]
    weights = [make_experts(16, 256, 384, seed=s) for s in range(3)]
    for moe, w in zip(layers, weights, strict=True):
        moe.load(w.gate, w.up, w.down)
    streamer = LayerStreamer(layers, torch.device("cuda"))
    for _ in range(2):  # two passes: the staging buffers are reused across passes
        streamer.begin(tokens, 4, split=False)
        for i, (moe, w) in enumerate(zip(layers, weights, strict=True)):
            g = torch.Generator().manual_seed(100 * i + tokens)
            x = torch.randn(tokens, 256, generator=g)
            ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
            gate = torch.rand(tokens, 4, generator=g)
            out = streamer.compute(i, x.cuda(), ids.cuda(), gate.cuda()).cpu()
            ref = w.reference(x, ids, gate)
            cpu = moe.forward(x, ids, gate)
            if fmt == "int4":  # asymmetric least-squares int4: as close as the CPU kernels
                assert rel_error(out, ref) <= 1.05 * rel_error(cpu, ref)
                assert rel_error(out, cpu.double()) < 0.06
            else:
                assert rel_error(out, ref) < (0.01 if fmt == "bf16" else 0.03)
                assert rel_error(out, cpu.double()) < 0.03


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 33, 700])
def test_split_layers_equal_the_cpu_experts(fmt: str, tokens: int) -> None:
    """Each layer's lightest experts on the CPU, the rest copied (packed side by side) and run
    on the GPU: the sum equals the CPU experts alone."""
    layers = [CpuMoE(16, 256, 384, fmt) for _ in range(3)]
    weights = [make_experts(16, 256, 384, seed=s) for s in range(3)]
    for moe, w in zip(layers, weights, strict=True):
        moe.load(w.gate, w.up, w.down)
    streamer = LayerStreamer(layers, torch.device("cuda"))
    # Costs that put some experts on each side at every length tried.
    streamer.costs = SplitCosts(cpu_fixed=1e-6, cpu_token=2e-7, gpu_expert=3e-6)
    for _ in range(2):
        streamer.begin(tokens, 4, split=True)
        assert streamer.split
        for i, (moe, w) in enumerate(zip(layers, weights, strict=True)):
            g = torch.Generator().manual_seed(100 * i + tokens)
            x = torch.randn(tokens, 256, generator=g)
            ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
            gate = torch.rand(tokens, 4, generator=g)
            counts = torch.bincount(ids.reshape(-1), minlength=16)
            if tokens == 700:
                on_gpu = plan_split(counts, streamer.costs)
                assert 0 < int(on_gpu.sum()) < int((counts > 0).sum())
            out = streamer.start_split(i, x.cuda(), ids.cuda(), gate.cuda())().cpu()
            ref = w.reference(x, ids, gate)
            cpu = moe.forward(x, ids, gate)
            if fmt == "int4":
                assert rel_error(out, ref) <= 1.05 * rel_error(cpu, ref) + 1e-3
                assert rel_error(out, cpu.double()) < 0.06
            else:
                assert rel_error(out, ref) < (0.01 if fmt == "bf16" else 0.03)
                assert rel_error(out, cpu.double()) < 0.03
