"""The decode projections' kernels (kernels/norm_gemv.py: RMSNorm then x W^T; kernels/
gemv_residual.py: h + x W^T) against a float64 reference and against the torch ops they replace
(ops/fused.py `rms_norm`, `linear`, the residual's `h + o`): rows 1..8 (and 16, the most), odd N
and K (no multiple of a block), bias, a weight with rows wider than K, bf16 / fp16 / fp32, one
pass and split K; then their errors, `GemvConfig`'s checks and the dispatch rule `gemv_fits`. On
the GPU when there is one, else under Triton's interpreter (tests/kernels/conftest.py); the
real-shape tests under a compiled step's CUDA graph are device tests."""

from __future__ import annotations

import pytest
import torch
from hopper_compile import assert_compiles_for_hopper

from hetmoe.kernels import gemv_config
from hetmoe.kernels.gemv_config import GemvConfig, config_for, gemv_fits, parse_gemv_config
from hetmoe.kernels.gemv_residual import gemv_residual
from hetmoe.kernels.norm_gemv import norm_gemv
from hetmoe.ops import fused

HERE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
SMALL = GemvConfig(16, 32, 1, 4, 2)
"""A small K step, so the interpreter's loops take several steps at these small K."""
SPLIT = GemvConfig(32, 32, 3, 4, 2)
"""Three K shares (the last one short at K = 83), the reduce launch, two N blocks per 64."""
FMA = GemvConfig(8, 32, 1, 4, 2, dot=False)
"""The FMA path: the real rows (a power of two), 8 rows of W a program."""
FMA_SPLIT = GemvConfig(4, 64, 3, 2, 2, dot=False)
"""The FMA path split in three K shares, 4 rows of W a program."""
CONFIGS = [SMALL, SPLIT, FMA, FMA_SPLIT]
CONFIG_IDS = ["one-pass", "split-k", "fma", "fma-split-k"]


def last_place(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """A unit in the last place of `want`'s dtype at max(|got|, |want|), in float64."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[want.dtype]
    top = torch.maximum(got.double().abs(), want.double().abs())
    return torch.exp2(torch.floor(torch.log2(top.clamp(min=torch.finfo(want.dtype).tiny)))
                      - mantissa)


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of `want`'s dtype at max(|got|, |want|)."""
    return (got.double() - want.double()).abs() / last_place(got, want)


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int, wide: int = 0
             ) -> tuple[torch.Tensor, ...]:
    """x [M, K] (rows of different scales), norm [K], weight [N, K] (a view of [N, K + wide]
    when `wide`), bias [N], h [M, N], on HERE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.5, 4.0, m)[:, None]
    norm = torch.rand(k, generator=g) + 0.5
    weight = torch.randn(n, k + wide, generator=g) * k ** -0.5
    bias, h = torch.randn(n, generator=g) * 0.1, torch.randn(m, n, generator=g)
    out = [t.to(dtype).to(HERE) for t in (x, norm, weight, bias, h)]
    out[2] = out[2][:, :k]
    return tuple(out)


def reference_norm_gemv(x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 RMSNorm(x) W^T + bias, and the bound of its error in x's dtype: the normalized
    x rounded twice (2 units of 2^-p relative each) and the output once."""
    x64, w64 = x.double(), weight.double()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * norm.double()
    y = xn @ w64.T + (bias.double() if bias is not None else 0.0)
    unit = torch.finfo(x.dtype).eps
    return y, 2 * unit * (xn.abs() @ w64.abs().T) + unit * y.abs() + 1e-30


def assert_sums_agree(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor,
                      weight: torch.Tensor) -> None:
    """got and want, two roundings of x [M, K] @ weight^T [N, K] summed in fp32 in other orders
    (or by tensor cores), differ by at most one unit in the last place plus fp32 summation's
    error bound, K 2^-24 sum |x||w| (Higham's gamma_K): near an output's zero, where the terms
    cancel, one unit is far below the sums' rounding, so "one ulp" alone bounds nothing there.
    A wrong row, norm or bias is off by the output's size: thousands of these bounds."""
    terms = x.double().abs() @ weight.double().abs().T  # [M, N]
    bound = last_place(got, want) + x.shape[1] * 2.0 ** -24 * terms
    excess = ((got.double() - want.double()).abs() / bound).max().item()
    assert excess <= 1, f"max |got - want| is {excess:.3g} times the bound"


def check_against_torch_ops(got: torch.Tensor, x: torch.Tensor, norm: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor | None,
                            config: GemvConfig | None) -> None:
    """`got` = norm_gemv(x, norm, EPS, weight, bias) against the torch ops, part by part: its
    normalized x (the kernel times the identity: exact products and one-term sums) within one
    rounding of `fused.rms_norm`'s (1/rms summed in another order, and on a GPU rsqrt in another
    instruction: an element may round the other way), and `got` against torch's linear of that
    normalized x (the same products, summed in another order: `assert_sums_agree`)."""
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    normalized = norm_gemv(x, norm, EPS, eye, config=config)
    assert ulps(normalized, fused.rms_norm(x, norm, EPS)).max() <= 1
    assert_sums_agree(got, fused.linear(normalized, weight, bias), normalized, weight)


CASES = [  # (M, N, K)
    (1, 77, 83), (2, 130, 64), (3, 50, 203), (4, 17, 33), (5, 96, 160), (7, 33, 99),
    (8, 61, 147), (16, 20, 40),
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("m", "n", "k"), CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_norm_gemv_against_float64_and_torch(m: int, n: int, k: int,
                                              config: GemvConfig) -> None:
    x, norm, weight, bias, _ = operands(m, n, k, torch.bfloat16, seed=m * 100 + n, wide=m % 3)
    with_bias = bias if m % 2 else None
    got = norm_gemv(x, norm, EPS, weight, with_bias, config=config)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    want, bound = reference_norm_gemv(x, norm, weight, with_bias)
    assert ((got.double() - want).abs() <= bound).all()
    check_against_torch_ops(got, x, norm, weight, with_bias, config)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("m", "n", "k"), CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_gemv_residual_against_float64_and_torch(m: int, n: int, k: int,
                                                  config: GemvConfig) -> None:
    x, _, weight, bias, h = operands(m, n, k, torch.bfloat16, seed=m * 7 + k, wide=m % 2)
    with_bias = bias if m > 4 else None
    plain = gemv_residual(x, weight, config=config)
    biased = gemv_residual(x, weight, None, with_bias, config=config)
    summed = gemv_residual(x, weight, h, with_bias, config=config)
    # the product rounded once (torch's linear), its fp32 sums within their error bound
    product = x.double() @ weight.double().T
    unit, terms = torch.finfo(torch.bfloat16).eps, x.double().abs() @ weight.double().abs().T
    assert ((plain.double() - product).abs() <= unit * product.abs() + k * 2.0 ** -24 * terms
            ).all()
    assert_sums_agree(biased, fused.linear(x, weight, with_bias), x, weight)
    assert torch.equal(summed, h + biased)  # the epilogue's add is the residual's, bit for bit


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype: torch.dtype) -> None:
    """fp16 as bf16 (16-bit products exact in fp32, so within one rounding of torch's); fp32 in
    IEEE dots (no TF32), within its sums' error of float64."""
    x, norm, weight, bias, h = operands(3, 45, 70, dtype, seed=5)
    got = norm_gemv(x, norm, EPS, weight, bias, config=SMALL)
    want, bound = reference_norm_gemv(x, norm, weight, bias)
    assert ((got.double() - want).abs() <= bound).all()
    summed = gemv_residual(x, weight, h, config=SPLIT)
    if dtype == torch.float16:
        plain = gemv_residual(x, weight, config=SPLIT)
        assert_sums_agree(plain, fused.linear(x, weight, None), x, weight)
        assert torch.equal(summed, h + plain)
        return
    # fp32: another summation order moves the last bits; bound the error against float64
    want = h.double() + x.double() @ weight.double().T
    unit, k = torch.finfo(dtype).eps, x.shape[1]
    bound = k * unit * (x.double().abs() @ weight.double().abs().T) + 2 * unit * want.abs()
    assert ((summed.double() - want).abs() <= bound).all()


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("m", [2, 6])
def test_default_configs_at_a_small_shape(m: int) -> None:
    """The launch shapes by rows (`config_for`): 2 rows take the FMA path, 6 the dot."""
    x, norm, weight, bias, h = operands(m, 40, 600, torch.bfloat16, seed=9)
    check_against_torch_ops(norm_gemv(x, norm, EPS, weight), x, norm, weight, None, None)
    plain = gemv_residual(x, weight)
    assert_sums_agree(plain, fused.linear(x, weight, None), x, weight)
    assert torch.equal(gemv_residual(x, weight, h), h + plain)
    assert config_for(gemv_config.NORM_GEMV_CONFIGS, m).dot == (m > 4)
    assert config_for(gemv_config.GEMV_CONFIGS, m).dot == (m > 4)


def test_bad_inputs_are_named() -> None:
    x, norm, weight, bias, h = operands(2, 8, 16, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=r"norm_gemv: x \[M, K\] with 1 <= M <= 16 rows "
                                         r"expected \(a decode batch\), got \(17, 16\)"):
        norm_gemv(x[:1].expand(17, 16), norm, EPS, weight)
    with pytest.raises(ValueError, match=r"gemv_residual: weight \[N, 16\] with unit stride "
                                         r"along K expected, got \(16, 8\)"):
        gemv_residual(x, weight.T, None)
    with pytest.raises(ValueError, match=r"gemv_residual: weight \[N, 16\] with unit stride"):
        gemv_residual(x, weight.T.contiguous().T)
    with pytest.raises(ValueError, match=r"gemv_residual: residual \[2, 8\] expected, got "
                                         r"\(2, 9\)"):
        gemv_residual(x, weight, torch.zeros(2, 9, dtype=x.dtype, device=x.device))
    with pytest.raises(ValueError, match=r"norm_gemv: bias \[8\] expected, got \(7,\)"):
        norm_gemv(x, norm, EPS, weight, bias[:7])
    with pytest.raises(ValueError, match=r"gemv_residual: weight is torch.float32 on .*, x "
                                         r"torch.bfloat16 on .*: one dtype and device expected"):
        gemv_residual(x, weight.float())
    with pytest.raises(ValueError, match=r"norm_gemv: norm \[16\] of x's dtype torch.bfloat16 "
                                         r"on .* expected, got \(16,\) torch.float32"):
        norm_gemv(x, norm.float(), EPS, weight)
    with pytest.raises(ValueError, match=r"gemv_residual: x of dtype bfloat16, float16 or "
                                         r"float32 expected, got torch.float64"):
        gemv_residual(x.double(), weight.double())


def test_launch_shapes_are_checked() -> None:
    assert parse_gemv_config("16,512,1,4,4,1") == GemvConfig(16, 512, 1, 4, 4)
    assert parse_gemv_config("8,256,1,4,4,0") == GemvConfig(8, 256, 1, 4, 4, dot=False)
    assert GemvConfig(16, 256, 2, 4, 4).programs(5120) == 640
    assert GemvConfig(16, 256, 1, 4, 4).block_m(3) == 16
    fma = GemvConfig(8, 256, 1, 4, 4, dot=False)
    assert (fma.block_m(1), fma.block_m(3), fma.block_m(8)) == (1, 4, 8)
    assert fma.fma_registers(3) == 4 * 8 * 256 // 128
    with pytest.raises(ValueError, match=r"GemvConfig: a tensor-core dot needs block_n >= 16, "
                                         r"got 8 \(dot=0 multiplies by FMAs\)"):
        GemvConfig(8, 512, 1, 4, 4)
    with pytest.raises(ValueError, match="gemv: no launch shape for 17 rows"):
        config_for(gemv_config.GEMV_CONFIGS, 17)
    with pytest.raises(ValueError, match="GemvConfig: block_n must be one of 4, 8, 16, 32, 64, "
                                         "128, got 2"):
        GemvConfig(2, 512, 1, 4, 4)
    with pytest.raises(ValueError, match="GemvConfig: split_k must be from 1 to 16, got 0"):
        GemvConfig(16, 512, 0, 4, 4)
    with pytest.raises(ValueError, match="GemvConfig: num_stages must be from 1 to 6, got 7"):
        GemvConfig(16, 512, 1, 4, 7)
    with pytest.raises(ValueError, match=r"gemv config '16,512,1': 6 comma-separated integers "
                                         r"expected \(block_n, block_k, split_k, num_warps, "
                                         r"num_stages, dot; dot 0 or 1\)"):
        parse_gemv_config("16,512,1")
    with pytest.raises(ValueError, match=r"gemv config '16,512,1,4,4,2': 6 comma-separated"):
        parse_gemv_config("16,512,1,4,4,2")


def test_the_decode_step_takes_the_kernels_by_rows_and_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemv_config.DECODE_GEMV_MAX_ROWS == 2  # where they beat cuBLAS on an H100
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 8)
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert gemv_fits(torch.zeros(1, 8, dtype=torch.bfloat16), w)
    assert gemv_fits(torch.zeros(8, 8, dtype=torch.bfloat16), w)
    assert not gemv_fits(torch.zeros(9, 8, dtype=torch.bfloat16), w)  # a GEMM: cuBLAS
    assert not gemv_fits(torch.zeros(2, 8), w.float())  # fp32 models keep torch's linear
    assert not gemv_fits(torch.zeros(2, 8, dtype=torch.float16), w.half())
    monkeypatch.setattr(gemv_config, "DECODE_GEMV_MAX_ROWS", 0)  # the kernels off
    assert not gemv_fits(torch.zeros(1, 8, dtype=torch.bfloat16), w)


SHAPES_FOR_HOPPER = """
import subprocess
from pathlib import Path

import triton
from hopper_compile import compile_for_hopper

from hetmoe.kernels.gemv_config import GEMV_CONFIGS, NORM_GEMV_CONFIGS, GemvConfig
from hetmoe.kernels.gemv_residual import gemv_kernel
from hetmoe.kernels.gemv_tiles import reduce_kernel
from hetmoe.kernels.norm_gemv import norm_chunk, norm_gemv_kernel

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
sig = dict.fromkeys(("x_ptr", "norm_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr"), "*bf16")
sig.update(part_ptr="*fp32", M="i32", N="i32", s_x="i32", s_w="i32", s_res="i32",
           s_out="i32", eps="fp32")


def no_spills(kernel, name):
    # ptxas's local memory (STACK) is spilled registers: the shapes we ship keep none
    cubin = Path("/tmp") / f"gemv_{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    assert "STACK:0 " in usage, (name, usage)


def build(c, m, k, bias, dtype="bf16", aligned=True):
    typed = {name: "*" + dtype if kind == "*bf16" else kind for name, kind in sig.items()}
    shape = dict(BLOCK_M=c.block_m(m), BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
                 DOT=c.dot, IEEE=dtype == "fp32", K=k, STAGES=c.num_stages)
    options = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    norm = compile_for_hopper(norm_gemv_kernel, typed, aligned=aligned, options=options,
                              BIAS=bias, CHUNK=norm_chunk(k, c.block_m(m)), **shape)
    gemv = compile_for_hopper(gemv_kernel, typed, aligned=aligned, options=options,
                              BIAS=not bias, RESIDUAL=True, **shape)
    return norm, gemv


for m in (1, 4, 8):  # the shipped shapes at Qwen3-30B-A3B's K (qkv 2048, o_proj 4096)
    for configs, k, at in ((NORM_GEMV_CONFIGS, 2048, 0), (GEMV_CONFIGS, 4096, 1)):
        c = next(c for rows, c in configs if m <= rows)
        no_spills(build(c, m, k, bias=True)[at], f"{at}_{m}")
for c in (GemvConfig(64, 128, 4, 8, 3), GemvConfig(4, 512, 2, 4, 4, dot=False)):
    build(c, 8, 2048, bias=False)
compile_for_hopper(reduce_kernel, sig, aligned=True, options={"num_warps": 4}, BLOCK_M=16,
                   BLOCK_N=128, SPLIT_K=4, BIAS=True, RESIDUAL=True)
for dtype in ("fp16", "fp32"):  # fp32: IEEE dots, odd sizes (unaligned)
    for c in (GemvConfig(32, 64, 2, 4, 2), GemvConfig(8, 64, 2, 4, 2, dot=False)):
        build(c, 3, 203, bias=False, dtype=dtype, aligned=False)
print("compiled")
"""


def test_the_kernels_compile_for_hopper() -> None:
    """The shipped shapes build for sm_90 at the real K and 1, 4, 8 rows without spilling, and
    split ones: bf16 and fp16 tensor-core dots and FMAs, fp32 IEEE dots (the interpreter above
    runs the IEEE branch and compiles nothing)."""
    assert_compiles_for_hopper(SHAPES_FOR_HOPPER)
