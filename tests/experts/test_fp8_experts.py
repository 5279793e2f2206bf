"""FP8 experts (weight_format "fp8"): e4m3 codes and block scales packed as the checkpoint holds
them, against a float64 oracle on the dequantized weights (the truth), on every ISA this machine
runs: odd sizes (zero-padded inside), decode (q = 1..4) and prefill (many tokens per expert), block
scales over a wide dynamic range, every non-NaN code; the fp32 forward and backward on the same
packing; GPU prefill's unpack on CPU tensors; bad inputs named.

DEVICE TEST: on a machine with AMX, `available_isas()` includes "amx" and "amx-all" runs the AMX
kernels for every call: that is the only coverage of csrc/kernels/amx_fp8.cpp (it was written on
a machine without AMX)."""

from __future__ import annotations

import math

import pytest
import torch
from moe_oracle import Experts, available_isas, rel_error

from hetmoe.experts import CpuMoE
from hetmoe.experts.expert_grad import expert_backward, expert_forward_fp32
from hetmoe.experts.fp8_weight import Fp8Scheme
from hetmoe.experts.packed_layout import host_tensor, unpack_group

ISA_VARIANTS = available_isas() + (["amx-all"] if "amx" in available_isas() else [])
BLOCK = (128, 128)
NAN_CODES = (0x7F, 0xFF)

# (experts, hidden, intermediate, q, k, block, group): decode q = 1..4, prefill q of tens to
# hundreds of rows per expert; odd sizes padded inside; blocks finer than and equal to the group.
CASES = [
    (3, 256, 128, 1, 1, BLOCK, None),
    (4, 200, 48, 2, 3, BLOCK, None),
    (5, 96, 160, 3, 2, (32, 32), 32),
    (3, 384, 256, 4, 2, (128, 64), 64),
    (3, 130, 72, 80, 2, (64, 128), 32),
    (4, 256, 256, 300, 3, BLOCK, 128),
]


def fp8_codes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Uniform over every non-NaN e4m3 code (subnormals, +-0 and +-448 included)."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    nan = (raw == NAN_CODES[0]) | (raw == NAN_CODES[1])
    return torch.where(nan, raw - 1, raw).view(torch.float8_e4m3fn)


def block_scales(rows: int, cols: int, block: tuple[int, int], num: int,
                 g: torch.Generator) -> torch.Tensor:
    """2^U(-20, 4) per block, times 1/448 (a checkpoint's amax / 448 form): 24 octaves."""
    shape = (num, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    return torch.exp2(torch.rand(shape, generator=g) * 24 - 20) / 448


class Fp8Layer:
    """One layer's FP8 experts: codes, scales and the dequantized float64 truth."""

    def __init__(self, e: int, h: int, i: int, block: tuple[int, int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.block = block
        self.codes = [fp8_codes(s, g) for s in ((e, i, h), (e, i, h), (e, h, i))]
        self.scales = [block_scales(c.shape[1], c.shape[2], block, e, g) for c in self.codes]
        scheme = Fp8Scheme(*block)
        truth = [torch.stack([scheme.dequantize(c[x], s[x]).double() for x in range(e)])
                 for c, s in zip(self.codes, self.scales, strict=True)]
        # Gate and up rows scaled so activations stay O(1) whatever the codes and scales.
        self.truth = Experts(*truth)

    def load(self, moe: CpuMoE) -> None:
        moe.load(*self.codes, *self.scales, fp8_block=self.block)


def _routing(q: int, k: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, e, (q, k), generator=g)
    ids[torch.rand(q, k, generator=g) < 0.15] = -1
    return ids, torch.rand(q, k, generator=g)


def _input(layer: Fp8Layer, q: int, g: torch.Generator) -> torch.Tensor:
    """x [q, H] whose gate/up outputs are O(1) for this layer's (wide-range) weights."""
    x = torch.randn(q, layer.truth.gate.shape[2], generator=g, dtype=torch.float64)
    norm = layer.truth.gate.abs().amax(dim=(0, 1)) + 1e-30  # [H]
    return (x / norm / x.shape[1] ** 0.5).float()


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("isa", ISA_VARIANTS)
def test_fp8_forward_matches_float64_on_the_dequantized_weights(isa: str, case: int) -> None:
    e, h, i, q, k, block, group = CASES[case]
    layer = Fp8Layer(e, h, i, block, seed=31 * case + ISA_VARIANTS.index(isa))
    moe = CpuMoE(e, h, i, "fp8", group_size=group, isa=isa.removesuffix("-all"),
                 amx_min_tokens=1 if isa == "amx-all" else 16)
    layer.load(moe)
    outs, refs = [], []
    for rep in range(max(1, 24 // q)):
        g = torch.Generator().manual_seed(1000 * case + rep)
        x = _input(layer, q, g).to(torch.bfloat16 if rep % 2 else torch.float32)
        ids, weights = _routing(q, k, e, g)
        out = moe.forward(x, ids, weights, out=torch.full_like(x, float("nan")))
        assert not out.isnan().any()
        outs.append(out)
        refs.append(layer.truth.reference(x, ids, weights))
    # bf16 activations (x and the hidden layer) bound the error, as for bf16 weights.
    assert rel_error(torch.cat(outs), torch.cat(refs)) <= 1e-2


@pytest.mark.parametrize("isa", available_isas())
def test_fp8_forward_per_output_within_bf16_of_its_own_magnitude(isa: str) -> None:
    """Down's row blocks carry scales 2^24 apart: each output is checked against the float64
    sum of its terms' magnitudes, so a wrong block scale shows on the small outputs too."""
    e, h, i, q, k = 2, 256, 256, 4, 2
    layer = Fp8Layer(e, h, i, (16, 128), seed=5)
    moe = CpuMoE(e, h, i, "fp8", isa=isa)
    layer.load(moe)
    g = torch.Generator().manual_seed(6)
    x = _input(layer, q, g)
    ids, weights = _routing(q, k, e, g)
    ids[:, 0] = torch.arange(q) % e
    out = moe.forward(x, ids, weights).double()
    ref = layer.truth.reference(x, ids, weights)
    magnitude = Experts(*(w.abs() for w in (layer.truth.gate, layer.truth.up,
                                            layer.truth.down))).reference(x.abs(), ids, weights)
    assert ((out - ref).abs() <= 2e-2 * magnitude + 1e-30).all()


def _backward_errors(layer: Fp8Layer, moe: CpuMoE, x: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor, g: torch.Generator) -> tuple[float, float]:
    """Relative errors of `expert_backward`'s dx and dweights (math by x's dtype) for a random
    dY, against float64 autograd on the layer's exact weights."""
    dy = torch.randn(x.shape[0], x.shape[1], generator=g)
    dx, dw = expert_backward(moe, x, ids, weights, dy)
    x64 = x.double().requires_grad_()
    w64 = weights.double().requires_grad_()
    (layer.truth.reference(x64, ids, w64) * dy.double()).sum().backward()
    assert x64.grad is not None and w64.grad is not None
    return rel_error(dx, x64.grad), rel_error(dw, w64.grad)


@pytest.mark.parametrize("isa", available_isas())
def test_fp8_fp32_forward_and_backward_read_the_codes_exactly(isa: str) -> None:
    """The training path unpacks the fp8 blocks in fp32: with fp32 activations it equals float64
    to fp32 rounding, which shows every code and scale is packed exactly."""
    e, h, i, q, k = 3, 200, 96, 9, 2
    layer = Fp8Layer(e, h, i, (32, 32), seed=11)
    moe = CpuMoE(e, h, i, "fp8", group_size=32, isa=isa)
    layer.load(moe)
    g = torch.Generator().manual_seed(12)
    x = _input(layer, q, g)
    ids, weights = _routing(q, k, e, g)
    out = expert_forward_fp32(moe, x, ids, weights)
    assert rel_error(out, layer.truth.reference(x, ids, weights)) < 1e-5
    dx_err, dw_err = _backward_errors(layer, moe, x, ids, weights, g)
    assert dx_err < 1e-5 and dw_err < 1e-5


@pytest.mark.parametrize("isa", available_isas())
def test_fp8_bf16_math_backward_within_bf16_rounding(isa: str) -> None:
    """bf16 x: the backward's bf16 math (the forward's fp8 kernels, transposed panels of the
    dequantized codes in bf16): within bf16 rounding of float64."""
    e, h, i, q, k = 3, 200, 96, 40, 2
    layer = Fp8Layer(e, h, i, (32, 32), seed=13)
    moe = CpuMoE(e, h, i, "fp8", group_size=32, isa=isa, amx_min_tokens=16)  # ~27 rows each
    layer.load(moe)
    g = torch.Generator().manual_seed(14)
    x = _input(layer, q, g).bfloat16()
    ids, weights = _routing(q, k, e, g)
    dx_err, dw_err = _backward_errors(layer, moe, x, ids, weights, g)
    assert dx_err < 1e-2 and dw_err < 1e-2


def test_fp8_unpacked_for_gpu_prefill_equal_the_dequantized_weights() -> None:
    """packed_layout's fp8 unpack (GPU prefill's view, here on CPU tensors): the dequantized
    weights rounded once to bf16; padding zero."""
    e, h, i = 3, 200, 48
    layer = Fp8Layer(e, h, i, BLOCK, seed=21)
    moe = CpuMoE(e, h, i, "fp8")
    layer.load(moe)
    (part,) = moe.packed_groups()
    raw = host_tensor(part).view(e, part.expert_bytes)
    gate_up, down = unpack_group(raw, part, "fp8", h, moe.group_size)
    s = part.end - part.begin
    truth = layer.truth
    pairs = [(gate_up[:, :i, :h], truth.gate), (gate_up[:, s:s + i, :h], truth.up),
             (down[:, :h, :i], truth.down)]
    for got, want in pairs:
        assert torch.equal(got, want.float().to(torch.bfloat16))
    assert not gate_up[:, i:s].any() and not gate_up[:, :, h:].any() and not down[:, :, i:].any()


def _valid(e: int = 2, h: int = 64, i: int = 64) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layer = Fp8Layer(e, h, i, BLOCK, seed=1)
    return [c[0] for c in layer.codes], [s[0] for s in layer.scales]


def test_fp8_bad_inputs_are_named() -> None:
    moe = CpuMoE(2, 64, 64, "fp8")
    (gate, up, down), (gs, us, ds) = _valid()
    with pytest.raises(ValueError, match=r"expert=0\): FP8 up needs .*up_scale of shape \[1, 1\]"
                                         r".*found \[2, 1\]"):
        moe.load_expert(0, gate, up, down, gs, torch.ones(2, 1), ds)
    with pytest.raises(ValueError, match=r"down must be float8_e4m3fn .*found \[64, 64\] "
                                         r"torch.float8_e5m2"):
        moe.load_expert(0, gate, up, down.float().to(torch.float8_e5m2), gs, us, ds)
    with pytest.raises(ValueError, match=r"gate must be float8_e4m3fn .*torch.bfloat16"):
        moe.load_expert(0, gate.bfloat16(), up, down, gs, us, ds)
    nan = gate.view(torch.uint8).clone()
    nan[3, 5] = 0x7F
    with pytest.raises(ValueError, match=r"gate holds NaN codes"):
        moe.load_expert(0, nan.view(torch.float8_e4m3fn), up, down, gs, us, ds)
    with pytest.raises(ValueError, match=r"down_scale holds non-finite"):
        moe.load_expert(0, gate, up, down, gs, us, torch.full_like(ds, float("inf")))
    with pytest.raises(ValueError, match=r"blocks \[128, 16\] must have .*group_size 64"):
        moe.load_expert(0, gate, up, down, gs, us, ds, fp8_block=(128, 16))
    moe.load_expert(0, gate, up, down, gs, us, ds)  # the valid call still works
