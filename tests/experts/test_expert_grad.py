"""The CPU experts' backward (csrc/moe/backward_job.cpp) against float64 autograd on the exactly
dequantized packed weights: every format, every ISA this machine runs, odd sizes, skipped and
duplicate ids, bf16 inputs, two NUMA groups, the fp32 and the bf16 math; errors named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grad_oracle import dequantized, make_call, reference_grads, rel_error

from hetmoe import _cpu
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.expert_grad import expert_backward, expert_forward_fp32

ISA_ORDER = ("scalar", "avx2", "avx512", "amx")
ISAS = ISA_ORDER[: ISA_ORDER.index(_cpu.best_isa()) + 1]
ODD_SHAPES = [(5, 72, 40, 1, 1), (4, 100, 200, 37, 3), (6, 64, 96, 9, 4), (3, 130, 24, 5, 2)]
WIDE = (3, 256, 250, 7, 2)  # room for the wide groups
# Past one 256-deep weight panel along H and 2I (partial sums carried between panels), full
# 12-row register tiles and a tail, an odd count of down n-blocks.
DEEP = (2, 520, 200, 30, 2)
CASES = ([(fmt, group, shape) for fmt, group in (("bf16", None), ("int8", 32), ("int4", 32))
          for shape in (*ODD_SHAPES, DEEP)]
         + [(fmt, group, WIDE) for fmt, group in (("int8", 128), ("int8", 256), ("int4", 64),
                                                  ("int4", 128))])


# bf16 math: x, dY and the SiLU's gradient rounded to bf16 (2^-9 relative each), the int
# formats' recompute on x quantized to u8 per group as their forward does (int4: with the
# coarser weights' larger hidden values); measured 2e-3 (bf16), 6e-3 (int8), 1e-2 to 2e-2 (int4).
BF16_MATH_TOL = {"bf16": 6e-3, "int8": 2.5e-2, "int4": 5e-2}
# bf16 math on the ISAs with bf16 GEMMs; amx-all: AMX tiles for every expert (amx_min_tokens 1).
BF16_ISAS = [isa for isa in ISAS if isa in ("avx512", "amx")] + (
    ["amx-all"] if "amx" in ISAS else [])


def _layer(fmt: str, group: int | None, e: int, h: int, i: int, isa: str,
           seed: int) -> CpuMoE:
    g = torch.Generator().manual_seed(seed)
    moe = CpuMoE(e, h, i, fmt, group_size=group, isa=isa.removesuffix("-all"),
                 amx_min_tokens=1 if isa == "amx-all" else None)
    moe.load(torch.randn(e, i, h, generator=g) / h**0.5, torch.randn(e, i, h, generator=g) / h**0.5,
             torch.randn(e, h, i, generator=g) / i**0.5)
    return moe


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("fmt", "group", "shape"), CASES)
def test_backward_equals_float64_autograd(isa: str, fmt: str, group: int | None,
                                          shape: tuple[int, int, int, int, int]) -> None:
    e, h, i, q, k = shape
    moe = _layer(fmt, group, e, h, i, isa, seed=sum(shape))
    x, ids, weights, dy = make_call(e, h, q, k, seed=q + k)
    dx, dw = expert_backward(moe, x, ids, weights, dy)
    ref_dx, ref_dw = reference_grads(dequantized(moe), x, ids, weights, dy)
    assert rel_error(dx, ref_dx) < 2e-6 * h**0.5, (isa, fmt)
    assert rel_error(dw, ref_dw) < 2e-6 * h**0.5, (isa, fmt)
    assert torch.all(dw[ids < 0] == 0)
    gate, up, down = dequantized(moe)
    ref_out = torch.zeros(q, h, dtype=torch.float64)
    for t in range(q):
        for j in range(k):
            if ids[t, j] >= 0:
                ex = ids[t, j]
                hid = torch.nn.functional.silu(gate[ex] @ x[t].double()) * (up[ex] @ x[t].double())
                ref_out[t] += weights[t, j].double() * (down[ex] @ hid)
    out = expert_forward_fp32(moe, x, ids, weights)
    assert rel_error(out, ref_out) < 2e-6 * h**0.5, (isa, fmt)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize(("fmt", "group", "shape"), CASES)
def test_bf16_math_is_within_its_rounding_of_float64(isa: str, fmt: str, group: int | None,
                                                     shape: tuple[int, int, int, int, int]
                                                     ) -> None:
    e, h, i, q, k = shape
    moe = _layer(fmt, group, e, h, i, isa, seed=sum(shape))
    x, ids, weights, dy = make_call(e, h, q, k, seed=q + k)
    xb = x.bfloat16()
    dx, dw = expert_backward(moe, xb, ids, weights, dy)  # bf16 x: bf16 math by default
    ref_dx, ref_dw = reference_grads(dequantized(moe), xb.float(), ids, weights, dy)
    assert rel_error(dx, ref_dx) < BF16_MATH_TOL[fmt], (isa, fmt)
    assert rel_error(dw, ref_dw) < BF16_MATH_TOL[fmt], (isa, fmt)
    assert torch.all(dw[ids < 0] == 0)
    # It is not the fp32 math (which is exact to fp32 rounding on the same input).
    fp32_dx, _ = expert_backward(moe, xb, ids, weights, dy, math="fp32")
    assert rel_error(fp32_dx, ref_dx) < 2e-6 * h**0.5 < rel_error(dx, ref_dx)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa in ("scalar", "avx2")])
def test_bf16_math_below_avx512_is_the_fp32_math(isa: str) -> None:
    moe = _layer("int8", 32, 4, 100, 200, isa, seed=8)
    x, ids, weights, dy = make_call(4, 100, 37, 3, seed=9)
    xb = x.bfloat16()
    bf16 = expert_backward(moe, xb, ids, weights, dy, math="bf16")
    fp32 = expert_backward(moe, xb, ids, weights, dy, math="fp32")
    assert all(torch.equal(a, b) for a, b in zip(bf16, fp32, strict=True))


def test_bf16_input_and_gpu_experts_skipped() -> None:
    e, h, i = 6, 96, 64
    moe = _layer("int8", 32, e, h, i, "auto", seed=3)
    x, ids, weights, dy = make_call(e, h, 11, 3, seed=4)
    mask = torch.zeros(e, dtype=torch.bool)
    mask[2] = True
    moe.set_gpu_experts(mask)
    xb = x.to(torch.bfloat16)
    dx, dw = expert_backward(moe, xb, ids, weights, dy, math="fp32")
    kept = torch.where(ids == 2, -1, ids)
    ref_dx, ref_dw = reference_grads(dequantized(moe), xb.float(), kept, weights, dy)
    assert rel_error(dx, ref_dx) < 2e-5 and rel_error(dw, ref_dw) < 2e-5
    assert torch.all(dw[ids == 2] == 0)


def test_two_numa_groups() -> None:
    # The pool's groups are fixed when it is built: a fresh process with two virtual groups.
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_expert_grad as t; "
            "t.test_backward_equals_float64_autograd('auto', 'int4', 32, (4, 100, 200, 37, 3)); "
            "t.test_backward_equals_float64_autograd('auto', 'bf16', None, (5, 72, 40, 1, 1)); "
            "t.BF16_ISAS and t.test_bf16_math_is_within_its_rounding_of_float64("
            "t.BF16_ISAS[-1], 'int8', 32, (4, 100, 200, 37, 3)); "
            "from hetmoe.experts.cpu_moe import CpuMoE; "
            "assert CpuMoE(2, 64, 200).num_groups == 2")
    env = dict(os.environ, HETMOE_NUMA_GROUPS="2", HETMOE_THREADS="2")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_errors_name_the_argument() -> None:
    moe = _layer("bf16", None, 4, 64, 32, "auto", seed=1)
    x, ids, weights, dy = make_call(4, 64, 3, 2, seed=1)
    with pytest.raises(ValueError, match=r"grad_out must be float \[3, 64\]"):
        expert_backward(moe, x, ids, weights, dy[:, :10])
    with pytest.raises(ValueError, match=r"x must be \[q, 64\]"):
        expert_backward(moe, x[:, :8], ids, weights, dy)
    with pytest.raises(ValueError, match="expert_ids must be"):
        expert_backward(moe, x, ids.int(), weights, dy)
    with pytest.raises(ValueError, match=r"math must be one of \('fp32', 'bf16'\), found 'fp16'"):
        expert_backward(moe, x, ids, weights, dy, math="fp16")
    bad = ids.clone()
    bad[2, 1] = 4
    with pytest.raises(ValueError, match=r"expert_ids\[2, 1\] = 4 is outside \[-1, 4\)"):
        expert_backward(moe, x, bad, weights, dy)
    fresh = CpuMoE(4, 64, 32)
    with pytest.raises(RuntimeError, match="expert .* never loaded"):
        expert_backward(fresh, x, ids.clamp(min=0), weights, dy)
