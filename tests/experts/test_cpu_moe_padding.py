"""Any expert size: hidden and intermediate sizes that are not multiples of 32 are zero-padded
inside the CPU backend. Against the float64 oracle, and bit for bit against the same layer padded
by hand (zero padding is exact), in every format, on every ISA, decode and prefill paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_oracle import available_isas, make_experts, rel_error

from hetmoe.experts import CpuMoE

BOUND = {"bf16": 1e-2, "int8": 2e-2, "int4": 0.15}

# (experts, hidden, intermediate, q, k): decode (q <= 4), prefill by column blocks (< 32 rows per
# expert), prefill by rows (>= 32); H = 40 and 100 are not multiples of 16 (a partial n-block of
# outputs), 72 not of 32, I = 48 not of 32, 200 spans several 64-blocks.
CASES = [
    (5, 40, 48, 1, 2),
    (5, 72, 48, 3, 4),
    (7, 40, 200, 7, 3),
    (5, 100, 48, 40, 3),
    (3, 72, 200, 200, 2),
]
ISA_VARIANTS = available_isas() + (["amx-all"] if "amx" in available_isas() else [])


def _layer(fmt: str, isa: str, num_experts: int, hidden: int, inter: int,
           group_size: int | None = None) -> CpuMoE:
    return CpuMoE(num_experts, hidden, inter, fmt, group_size=group_size,
                  isa=isa.removesuffix("-all"), amx_min_tokens=1 if isa == "amx-all" else 32)


def _call(q: int, k: int, num_experts: int, hidden: int,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(q, hidden, generator=g)
    ids = torch.randint(0, num_experts, (q, k), generator=g)
    ids[torch.rand(q, k, generator=g) < 0.2] = -1
    return x, ids, torch.rand(q, k, generator=g)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", ISA_VARIANTS)
def test_odd_sizes_match_the_float64_reference(isa: str, fmt: str, case: int) -> None:
    num_experts, hidden, inter, q, k = CASES[case]
    w = make_experts(num_experts, hidden, inter, seed=case)
    moe = _layer(fmt, isa, num_experts, hidden, inter)
    moe.load(w.gate, w.up, w.down)
    outs, refs = [], []
    for rep in range(max(1, 24 // q)):  # small calls repeated: the error is statistical
        x, ids, weights = _call(q, k, num_experts, hidden, seed=100 * case + rep)
        dtype = torch.bfloat16 if rep % 2 else torch.float32
        out = torch.full((q, hidden), float("nan"), dtype=dtype)
        moe.forward(x.to(dtype), ids, weights, out=out)
        assert not out.isnan().any(), "some outputs were never written"
        outs.append(out)
        refs.append(w.reference(x.to(dtype), ids, weights))
    err = rel_error(torch.cat(outs), torch.cat(refs))
    assert err <= BOUND[fmt], err


@pytest.mark.parametrize(("hidden", "inter", "padded_hidden", "padded_inter"),
                         [(40, 48, 64, 64), (72, 200, 128, 256), (100, 48, 128, 64)])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", ISA_VARIANTS)
def test_padding_inside_equals_padding_by_hand(isa: str, fmt: str, hidden: int, inter: int,
                                               padded_hidden: int, padded_inter: int) -> None:
    """The same experts zero-padded by hand to whole 64-blocks give the same bits: the padding
    the backend does inside is exact (same groups, same kernels)."""
    w = make_experts(5, hidden, inter, seed=hidden + inter)
    moe = _layer(fmt, isa, 5, hidden, inter)
    moe.load(w.gate, w.up, w.down)
    ph, pi = padded_hidden - hidden, padded_inter - inter
    padded = _layer(fmt, isa, 5, padded_hidden, padded_inter, moe.group_size)
    padded.load(F.pad(w.gate, (0, ph, 0, pi)), F.pad(w.up, (0, ph, 0, pi)),
                F.pad(w.down, (0, pi, 0, ph)))
    for q in (1, 3, 9, 40, 200):
        x, ids, weights = _call(q, 4, 5, hidden, seed=q)
        want = padded.forward(F.pad(x, (0, ph)), ids, weights)
        assert torch.equal(moe.forward(x, ids, weights), want[:, :hidden]), q
        assert not want[:, hidden:].any()


def test_default_groups_divide_the_sizes_rounded_to_32() -> None:
    assert CpuMoE(2, 40, 48, "int8").group_size == 64  # 64 and 64
    assert CpuMoE(2, 72, 48, "int8").group_size == 32  # 96 and 64
    assert CpuMoE(2, 2048, 48, "int8").group_size == 64
    assert CpuMoE(2, 40, 48, "int4").group_size == 32
    assert CpuMoE(2, 100, 200, "int8", group_size=32).group_size == 32


def test_a_group_that_does_not_divide_the_rounded_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"group_size must be 32, 64, 128 or 256 and divide "
                       r"hidden \(72\) and intermediate \(48\) rounded up to multiples of 32 "
                       r"\(padded: 96, 64\), got 64"):
        CpuMoE(2, 72, 48, "int8", group_size=64)
    with pytest.raises(ValueError, match=r"divide hidden \(64\) and intermediate \(96\) "
                       r"rounded up to multiples of 32, got 128"):
        CpuMoE(2, 64, 96, "int4", group_size=128)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_async_and_bound_calls_on_odd_sizes(fmt: str) -> None:
    """submit/sync and the buffers bound for flagged jobs keep H columns (no padded copies)."""
    w = make_experts(4, 40, 48, seed=9)
    moe = CpuMoE(4, 40, 48, fmt)
    moe.load(w.gate, w.up, w.down)
    x, ids, weights = _call(2, 2, 4, 40, seed=10)
    want = moe.forward(x, ids, weights)
    assert torch.equal(moe.sync(moe.submit(x, ids, weights)), want)
    out = torch.empty(2, 40)
    moe.bind(x, ids, weights, out)  # accepted at H = 40, the width HostLink's buffers have
    with pytest.raises(ValueError, match=r"x must be \[q, 40\] bfloat16 or float32"):
        moe.forward(torch.zeros(2, 64), ids, weights)
