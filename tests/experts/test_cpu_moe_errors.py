"""Every bad argument of CpuMoE is refused in Python with a message naming what and where."""

from __future__ import annotations

import os

import pytest
import torch
from moe_oracle import make_experts

from hetmoe import _cpu
from hetmoe.experts import CpuMoE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 0}, r"hidden must be a positive integer, got 0"),
        ({"intermediate": 48.0}, r"intermediate must be a positive integer, got 48.0"),
        ({"num_experts": 0}, r"num_experts must be a positive integer, got 0"),
        ({"weight_format": "fp4"},
         r"weight_format must be one of \['bf16', 'fp8', 'int4', 'int8'\]"),
        ({"weight_format": "int4", "group_size": 48}, r"group_size must be 32, 64, 128 or 256"),
        ({"weight_format": "int8", "group_size": 256}, r"divide hidden \(64\) and intermediate"),
        ({"weight_format": "int8", "group_size": 64, "hidden": 40, "intermediate": 72},
         r"divide hidden \(40\) and intermediate \(72\) rounded up to multiples of 32 "
         r"\(padded: 64, 96\), got 64"),
        ({"group_size": 32}, r"group_size applies to int8/int4/fp8 only"),
        ({"activation": "gelu"}, r"activation must be 'silu', got 'gelu'"),
        ({"threads": 0}, r"threads must be None or a positive integer, got 0"),
        ({"isa": "sse9"}, r"unknown ISA 'sse9': expected one of auto, amx, avx512, avx2, scalar"),
    ],
)
def test_constructor_errors(kwargs: dict, message: str) -> None:
    args = {"num_experts": 3, "hidden": 64, "intermediate": 96} | kwargs
    with pytest.raises(ValueError, match=message):
        CpuMoE(**args)


def test_unavailable_isa_names_the_missing_feature() -> None:
    best = _cpu.best_isa()
    if best == "amx":
        pytest.skip("this CPU runs every ISA; the refusal is covered where AMX is missing")
    with pytest.raises(ValueError, match=r"ISA 'amx' was requested but this CPU/OS lacks AMX"):
        CpuMoE(3, 64, 96, isa="amx")


@pytest.fixture(scope="module")
def layer() -> CpuMoE:
    w = make_experts(3, 64, 96, seed=1)
    moe = CpuMoE(3, 64, 96, "int8")
    moe.load_expert(0, w.gate[0], w.up[0], w.down[0])
    moe.load_expert(1, w.gate[1], w.up[1], w.down[1])
    return moe


def test_amx_is_emulated_only_in_the_developer_build() -> None:
    """CMake's HETMOE_AMX_EMULATION build (csrc/testing/amx_emulation.h) reports AMX on any
    AVX-512 CPU with VBMI (the AMX files' vector code runs natively); every other build reports
    what the CPU and OS grant. CI runs the kernel tests once more on the emulated build, where
    this checks that it is the one loaded."""
    features = _cpu.cpu_features()
    if os.environ.get("HETMOE_EXPECT_AMX_EMULATION") == "1":
        assert _cpu.AMX_EMULATION and _cpu.best_isa() == "amx" and features["amx_permitted"], (
            f"emulated AMX expected: AMX_EMULATION={_cpu.AMX_EMULATION}, best_isa="
            f"{_cpu.best_isa()!r}, avx512_vbmi={features['avx512_vbmi']}")
    else:
        assert not _cpu.AMX_EMULATION
        assert _cpu.best_isa() != "amx" or (features["amx_tile"] and features["amx_permitted"])


def test_load_errors(layer: CpuMoE) -> None:
    w = make_experts(3, 64, 96, seed=2)
    with pytest.raises(ValueError, match=r"gate must be \[3, 96, 64\] .* found \[3, 64, 96\]"):
        layer.load(w.down, w.up, w.down)
    with pytest.raises(ValueError, match=r"expert must be in \[0, 3\), got 3"):
        layer.load_expert(3, w.gate[0], w.up[0], w.down[0])
    with pytest.raises(ValueError, match=r"down must be \[64, 96\] bf16/fp16/fp32/fp8, found .*64"):
        layer.load_expert(2, w.gate[2], w.up[2], w.down[2].long())
    with pytest.raises(ValueError, match=r"FP8 gate needs gate_scale of shape \[1, 1\]"):
        layer.load_expert(2, w.gate[2].to(torch.float8_e4m3fn), w.up[2], w.down[2])
    with pytest.raises(ValueError, match=r"up_scale is only for FP8 weights"):
        layer.load_expert(2, w.gate[2], w.up[2], w.down[2], up_scale=torch.ones(1, 1))
    with pytest.raises(TypeError, match=r"gate must be a torch.Tensor, got list"):
        layer.load_expert(2, [1.0], w.up[2], w.down[2])


def test_forward_errors(layer: CpuMoE) -> None:
    x = torch.randn(4, 64)
    ids = torch.tensor([[0, 1], [1, -1], [0, 0], [-1, -1]])
    wts = torch.rand(4, 2)
    bad = [
        ((x[:, :32].contiguous(), ids, wts), r"x must be \[q, 64\] bfloat16 or float32, found \["),
        ((x.half(), ids, wts), r"x must be .* found \[4, 64\] torch.float16"),
        ((x.t(), ids, wts), r"x must be a contiguous 2-D CPU tensor"),
        ((x, ids.int(), wts), r"expert_ids must be \[4, k\] int64 with k >= 1, found .*int32"),
        ((x, ids[:3], wts), r"expert_ids must be \[4, k\] int64"),
        ((x, ids, wts.double()), r"expert_weights must be float32 of the shape of expert_ids"),
        ((x, ids + 2, wts), r"expert_ids\[0, 1\] = 3 is outside \[-1, 3\)"),
        ((x, ids - 1, wts), r"expert_ids\[1, 1\] = -2 is outside \[-1, 3\)"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            layer.forward(*args)
    out_bad = r"out must be a contiguous CPU tensor \[4, 64\] torch.float32"
    with pytest.raises(ValueError, match=out_bad):
        layer.forward(x, ids, wts, out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"expert 2 is routed to but its weights were never"):
        layer.forward(x, torch.tensor([[0, 2]] * 4), wts)
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \[3\], found \(2,\)"):
        layer.set_gpu_experts(torch.zeros(2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"no submitted call is pending"):
        layer.sync()
    with pytest.raises(RuntimeError, match=r"submit_flagged: call bind\(x, ids, weights, out\) "
                                         r"first"):
        CpuMoE(3, 64, 96).submit_flagged(object())
    with pytest.raises(ValueError, match=r"CpuMoE.bind: x must have at least one token"):
        layer.bind(torch.empty(0, 64), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2),
                   torch.empty(0, 64))
    with pytest.raises(ValueError, match=r"out must be a contiguous CPU tensor \[4, 64\]"):
        layer.bind(x, ids, wts, torch.empty(4, 32))


def test_empty_batch_and_all_skipped(layer: CpuMoE) -> None:
    no_ids = torch.empty(0, 2, dtype=torch.int64)
    empty = layer.forward(torch.empty(0, 64), no_ids, torch.empty(0, 2))
    assert empty.shape == (0, 64)
    call = layer.submit(torch.empty(0, 64), no_ids, torch.empty(0, 2))
    assert call.handle is None  # nothing submitted, nothing to wait for
    assert layer.sync(call).shape == (0, 64)
    out = layer.forward(torch.randn(2, 64), torch.full((2, 3), -1), torch.rand(2, 3))
    assert torch.equal(out, torch.zeros(2, 64))
