"""Programmatic dependent launch (kernels/pdl.py) on the GPU (`pytest -m device`): the decode
step's kernels chained as a step chains them (input norm + q/k/v, attention with its cache
write, o_proj, router, the two pair kernels, the residual) over 4 layers, captured in a CUDA
graph with dependent launches and without, each replayed 20 times on the same inputs: the same
bits in every replay and both ways (a kernel that read an input before the kernel writing it had
finished, or wrote a buffer the kernel before it still read, would show as a difference). The
switch itself (`allowed`, HETMOE_DEPENDENT_LAUNCH) is tested on any machine in test_pdl.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_packed_moe import make_layer

from hetmoe.bench.cuda_graphs import capture
from hetmoe.kernels import pdl
from hetmoe.kernels.gemv_residual import gemv_residual
from hetmoe.kernels.gqa_decode import gqa_decode_attention
from hetmoe.kernels.moe_router import moe_router, row_tickets
from hetmoe.kernels.norm_gemv import norm_gemv
from hetmoe.kernels.packed_moe import packed_moe

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

H, HEADS, KV_HEADS, D, EXPERTS, TOP_K, LAYERS, EPS = 256, 4, 2, 64, 8, 2, 4, 1e-6


def test_on_for_hopper_inside_allowed_alone() -> None:
    cuda = torch.device("cuda")
    assert not pdl.enabled(cuda) and pdl.launch_args(cuda) == {"PDL": False}
    with pdl.allowed(True):
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl.enabled(cuda) == hopper
        assert pdl.launch_args(cuda) == ({"PDL": True, "launch_pdl": True} if hopper
                                         else {"PDL": False})
    assert not pdl.enabled(cuda)


def decode_chain() -> Callable[[], torch.Tensor]:
    """A step over LAYERS random layers at batch 1, from a fixed random hidden row."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    layers = []
    for n in range(LAYERS):
        experts = make_layer("int8", EXPERTS, H, 128, 32, seed=n)
        layers.append(dict(
            norms=(rand(H) + 1, rand(H) + 1, rand(D) + 1, rand(D) + 1),
            qkv=rand((HEADS + 2 * KV_HEADS) * D, H, scale=H ** -0.5),
            o=rand(H, HEADS * D, scale=(HEADS * D) ** -0.5), router=rand(EXPERTS, H),
            cache=rand(1, 128, 2, KV_HEADS, D), packed=experts.raw.cuda(), part=experts.part))
    h0 = rand(1, H)
    tickets = row_tickets(64, "cuda")
    zero, pos, slots = (torch.tensor([v], device="cuda") for v in (0, 70, 0))
    angles = torch.rand(1, D, device="cuda", generator=g) * 6
    cos, sin = angles.cos(), angles.sin()

    def step() -> torch.Tensor:
        h = h0
        for w in layers:
            qkv = norm_gemv(h, w["norms"][0], EPS, w["qkv"])
            q, k, v = (t.view(1, -1, D) for t in qkv.split(
                [HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1))
            attn = gqa_decode_attention(q, k, v, w["cache"], slots, zero, pos, 2, D ** -0.5,
                                        w["norms"][2], w["norms"][3], EPS, cos, sin)
            o = gemv_residual(attn.view(1, -1), w["o"])
            h, x, stage = moe_router(h, o, w["norms"][1], EPS, w["router"], None, tickets,
                                     TOP_K, False, True, 1.0, False, True)
            ids = stage[H:H + 2 * TOP_K].view(torch.int64).view(1, TOP_K)
            weights = stage[H + 2 * TOP_K:].view(torch.float32).view(1, TOP_K)
            out = packed_moe(x, ids, weights, w["packed"], w["part"], "int8", H, 32,
                             path="pairs")
            h = (h.float() + out).bfloat16()
        return h

    return step


def replays(step: Callable[[], torch.Tensor], times: int) -> list[torch.Tensor]:
    """`step` run once (its kernels compile), captured, replayed `times` times -> the outputs."""
    graph, out = capture(step)
    outs = []
    for _ in range(times):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="dependent launches need compute capability 9.0+")
def test_a_graph_of_dependent_launches_gives_the_same_bits() -> None:
    step = decode_chain()
    plain = replays(step, 20)
    with pdl.allowed(True):
        assert pdl.enabled(torch.device("cuda"))
        dependent = replays(step, 20)
    assert plain[0].isfinite().all() and plain[0].abs().max() > 0
    for out in plain + dependent:
        assert torch.equal(out, plain[0])
