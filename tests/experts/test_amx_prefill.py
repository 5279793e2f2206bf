"""Prefill-sized calls (tens of rows per expert), where the AMX kernels run one n-block pair over
every token tile (bf16 in K chunks, int with the fix-up of one token tile overlapping the next
tile's products; int4 through bf16 tiles) and the epilogues (SiLU, u8 groups) have AVX-512
forms: against float64, and int formats bit for bit against every other ISA of this machine (int4
on AMX: at least as close to float64, moe_oracle.check_int_isas)."""

from __future__ import annotations

import pytest
import torch
from moe_oracle import available_isas, check_int_isas, make_experts, rel_error

from hetmoe.experts import CpuMoE


def _routing(q: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (some slots -1), uneven rows per expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(q, num_experts, generator=g).argsort(dim=1)[:, :k].contiguous()
    ids[torch.rand(q, k, generator=g) < 0.1] = -1
    return ids, torch.rand(q, k, generator=g)


@pytest.mark.parametrize(("weight_format", "group_size", "bound"),
                         [("int8", 32, 2e-2), ("int8", 64, 2e-2), ("int8", 128, 2e-2),
                          ("int4", 32, 0.15), ("int4", 64, 0.2), ("int4", 256, 0.2)])
def test_int_prefill_same_bits_on_every_isa(weight_format: str, group_size: int,
                                            bound: float) -> None:
    """~40-60 rows per expert (3-4 token tiles, the last one partial), AMX for every expert call:
    within the format's bound of float64, and the same floats on every ISA (int4 on AMX: see
    check_int_isas)."""
    E, H, I, q, k = 3, 256, 256, 80, 2
    layer = make_experts(E, H, I, seed=71 + group_size)
    x = torch.randn(q, H, generator=torch.Generator().manual_seed(72))
    ids, weights = _routing(q, k, E, seed=73)
    outs = {}
    for isa in available_isas():
        moe = CpuMoE(E, H, I, weight_format, group_size=group_size, isa=isa, amx_min_tokens=1)
        moe.load(layer.gate, layer.up, layer.down)
        outs[isa] = moe.forward(x, ids, weights, out=torch.full_like(x, float("nan")))
    check_int_isas(weight_format, outs, layer.reference(x, ids, weights), bound)


def test_bf16_prefill_k_chunks() -> None:
    """BF16 with several K chunks and a partial one (H=512: 16 k-steps of 32; I=288: 9) and 2-3
    token-tile pairs per expert: AMX within 1e-2 of float64 and close to AVX-512."""
    E, H, I, q, k = 3, 512, 288, 90, 2
    layer = make_experts(E, H, I, seed=81)
    x = torch.randn(q, H, generator=torch.Generator().manual_seed(82))
    ids, weights = _routing(q, k, E, seed=83)
    ref = layer.reference(x, ids, weights)
    outs = {}
    for isa in available_isas()[-2:]:
        moe = CpuMoE(E, H, I, "bf16", isa=isa, amx_min_tokens=1)
        moe.load(layer.gate, layer.up, layer.down)
        outs[isa] = moe.forward(x, ids, weights, out=torch.full_like(x, float("nan")))
        assert rel_error(outs[isa], ref) <= 1e-2, isa
    if len(outs) == 2:
        a, b = outs.values()
        assert rel_error(a, b.double()) < 1e-4


@pytest.mark.parametrize(("hidden", "intermediate", "expected"),
                         [(2048, 768, 128), (2880, 768, 64), (96, 64, 32)])
def test_int8_default_group_is_the_largest_dividing_128_64_32(hidden: int, intermediate: int,
                                                             expected: int) -> None:
    """Int8 groups of 128 by default (one AMX fix-up per 128 inputs; layer error 0.0176 against
    the 2e-2 bar), else the largest of 64 and 32 dividing both widths."""
    assert CpuMoE(2, hidden, intermediate, "int8").group_size == expected
