"""The AMX int4 kernel on int8 tiles (kernels/amx_int4_i8.cpp, opt-in: HETMOE_AMX_INT4=i8) one
call at a time (hetmoe._cpu_kernel_testing): against float64 of the values it is given (the
packed weights dequantized, the u8 rows dequantized) within its derived bound, and against today's
AMX int4 kernel (bf16 tiles) within that bound plus the bf16 kernel's own rounding. Runs on AMX
hosts and on the emulated-AMX build; the variable's checks run everywhere.

The bound, per output c[t, n] = sum_k x_k w_k: the rows are requantized to x ~ rs x8 (rs = max |x|
/ 127 per row; |x - rs x8| <= rs / 2) and the weights to w ~ S w8 on the channel's grid S (its
largest dequantized magnitude / 127; fixed point: |w - S w8| <= (1/2 + 8/256) S), so
|x w - rs x8 S w8| <= |x| e S + (rs / 2) (|w| + e S) with e = 17/32, summed over k; plus float32
slack (1e-5 of sum |x| |w| and of K rs S)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetmoe import _cpu

AMX = _cpu.best_isa() == "amx"
needs_amx = pytest.mark.skipif(not AMX, reason="needs AMX (or the emulated-AMX build)")
E_W = 17 / 32  # weight remap error, in steps of S


def _call(kernel: str, w: torch.Tensor, x: torch.Tensor, group_size: int, split: int = 0,
          tiled: bool = False, stream: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel call: c [m, n] (fp32), w_deq [n, k], x_deq [m, k] and grid [n] (float64)."""
    from hetmoe import _cpu_kernel_testing

    (n, k), m = w.shape, x.shape[0]
    w, x = w.float().contiguous(), x.float().contiguous()
    c = torch.full((m, n), float("nan"))
    w_deq = torch.empty(n, k, dtype=torch.float64)
    x_deq = torch.empty(m, k, dtype=torch.float64)
    grid = torch.empty(n, dtype=torch.float64)
    _cpu_kernel_testing.amx_int4_gemm(kernel, w.data_ptr(), n, k, group_size, x.data_ptr(), m,
                                      split, tiled, stream, c.data_ptr(), w_deq.data_ptr(),
                                      x_deq.data_ptr(), grid.data_ptr())
    return c, w_deq, x_deq, grid


def _bound(w_deq: torch.Tensor, x_deq: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """[m, n]: the i8 kernel's worst-case distance from x_deq @ w_deq^T (module docstring)."""
    rs = x_deq.abs().amax(dim=1, keepdim=True) / 127  # [m, 1]
    ax, aw = x_deq.abs(), w_deq.abs()
    k = x_deq.shape[1]
    worst = (ax.sum(1, keepdim=True) * (E_W * grid) + rs / 2 * aw.sum(1)
             + k * rs / 2 * E_W * grid)
    return worst + 1e-5 * (ax @ aw.T) + 1e-5 * k * rs * grid + 1e-30


def _data(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weights [n, k] with heavy-tailed channels and one all-zero channel (grid 0),
    Gaussian rows [m, k] with an outlier input column."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[1::5] *= torch.randn(k, generator=g).abs() * 3
    w[n // 2] = 0
    x = torch.randn(m, k, generator=g)
    x[:, k // 3] *= 20
    return w, x


# (m, n, k, group size, n-block split, rows in tile order, streamed c): m 1..70 (partial token
# tiles and pairs), n and k not multiples of 16 / 64 (padded), odd n-block counts.
CASES = [
    (1, 33, 200, 32, 0, False, False),
    (15, 48, 64, 64, 0, True, False),
    (16, 16, 128, 128, 0, False, True),
    (17, 80, 256, 128, 2, False, True),
    (32, 16, 128, 32, 0, True, True),
    (33, 40, 320, 64, 1, False, False),
    (47, 61, 700, 32, 0, True, False),
    (64, 96, 384, 128, 3, False, False),
    (70, 72, 500, 32, 3, True, True),
]


@needs_amx
@pytest.mark.parametrize(("m", "n", "k", "group_size", "split", "tiled", "stream"), CASES)
def test_i8_kernel_within_its_bound_of_float64(m: int, n: int, k: int, group_size: int,
                                               split: int, tiled: bool, stream: bool) -> None:
    """Every output within the derived bound of float64 (measured: at most 0.28 of it); the
    all-zero channel exactly 0; the relative error under 5 % (measured 0.9-3.8 %, most of it
    the per-row grid stretched by the 20x input column; the bf16 tile kernel's is 0.25 %)."""
    w, x = _data(m, n, k, seed=m * 1000 + n + group_size)
    c, w_deq, x_deq, grid = _call("i8", w, x, group_size, split, tiled, stream)
    ref = x_deq @ w_deq.T
    bound = _bound(w_deq, x_deq, grid)
    excess = (c.double() - ref).abs() - bound
    worst = divmod(int(excess.argmax()), n)
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at (row, col) {worst}"
    assert torch.all(c[:, n // 2] == 0)
    assert (c.double() - ref).norm() / ref.norm() < 0.05


@needs_amx
@pytest.mark.parametrize(("m", "n", "k", "group_size"), [(5, 48, 256, 32), (40, 33, 320, 64),
                                                         (70, 64, 512, 128)])
def test_i8_kernel_close_to_the_bf16_tile_kernel(m: int, n: int, k: int, group_size: int) -> None:
    """Within the i8 bound plus the bf16 kernel's rounding of both operands (2^-9 each, fp32
    sums) of today's AMX int4 kernel on the same inputs."""
    w, x = _data(m, n, k, seed=7 + m)
    c8, w_deq, x_deq, grid = _call("i8", w, x, group_size)
    c16 = _call("bf16", w, x, group_size)[0]
    bf16_err = (2 ** -8 + 2 ** -17) * (x_deq.abs() @ w_deq.abs().T)
    excess = (c8.double() - c16.double()).abs() - (_bound(w_deq, x_deq, grid) + bf16_err)
    assert excess.max() <= 0


@needs_amx
def test_i8_kernel_refuses_k_past_the_int32_bound() -> None:
    """K past 65536 could overflow the int32 sums (255 * 127 per product): refused, named."""
    w, x = torch.zeros(16, 65536 + 64), torch.zeros(1, 65536 + 64)
    with pytest.raises(ValueError, match=r"K = 65600 exceeds 65536"):
        _call("i8", w, x, 64)


def _python(code: str, value: str | None) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter with HETMOE_AMX_INT4 = value (None: unset)."""
    env = {key: v for key, v in os.environ.items() if key != "HETMOE_AMX_INT4"}
    if value is not None:
        env["HETMOE_AMX_INT4"] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("value", "kernel"), [(None, "bf16"), ("bf16", "bf16"), ("i8", "i8")])
def test_the_variable_picks_the_kernel(value: str | None, kernel: str) -> None:
    run = _python("from hetmoe import _cpu; print(_cpu.amx_int4_kernel())", value)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == kernel


def test_a_bad_value_is_refused_with_the_variables_name() -> None:
    code = ("from hetmoe import _cpu\n"
            "try:\n    _cpu.amx_int4_kernel()\nexcept ValueError as e:\n    print(e)\n")
    if AMX:  # the layer refuses it when made, before any call
        code += ("from hetmoe.experts import CpuMoE\n"
                 "try:\n    CpuMoE(2, 64, 64, 'int4', isa='amx')\nexcept ValueError as e:\n"
                 "    print(e)\n")
    run = _python(code, "int8")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == (2 if AMX else 1)
    for line in lines:
        assert "HETMOE_AMX_INT4='int8': expected unset, 'bf16' or 'i8'" in line


@needs_amx
def test_a_layer_on_the_i8_kernel(tmp_path: Path) -> None:
    """With HETMOE_AMX_INT4=i8 an int4 layer's AMX experts run the kernel: within int4's layer
    bound (0.15) of float64 and within 0.03 of the same layer on the bf16 tile kernel."""
    code = """
import torch
from moe_oracle import make_experts, rel_error
from hetmoe import _cpu
from hetmoe.experts import CpuMoE
E, H, I, q = 3, 256, 192, 80
layer = make_experts(E, H, I, seed=5)
x = torch.randn(q, H, generator=torch.Generator().manual_seed(6))
ids = torch.stack([torch.arange(q) % E, (torch.arange(q) + 1) % E], 1)
wts = torch.rand(q, 2, generator=torch.Generator().manual_seed(7))
moe = CpuMoE(E, H, I, "int4", group_size=32, isa="amx", amx_min_tokens=1)
moe.load(layer.gate, layer.up, layer.down)
out = moe.forward(x, ids, wts)
print(_cpu.amx_int4_kernel(), rel_error(out, layer.reference(x, ids, wts)))
torch.save(out, "{path}")
"""
    outs, errors = {}, {}
    for kernel in ("bf16", "i8"):
        path = tmp_path / f"{kernel}.pt"
        env_code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        run = _python(env_code + code.replace("{path}", str(path)), kernel)
        assert run.returncode == 0, run.stderr
        name, error = run.stdout.split()
        assert name == kernel
        errors[kernel] = float(error)
        outs[kernel] = torch.load(path)
    assert errors["i8"] <= 0.15, errors
    diff = (outs["i8"] - outs["bf16"]).norm() / outs["bf16"].norm()
    assert diff < 0.03, (diff, errors)
