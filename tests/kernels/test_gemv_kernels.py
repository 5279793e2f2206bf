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
from hetmoe.kernels.gemv_config import GemvConfig, gemv_fits, parse_gemv_config
from hetmoe.kernels.gemv_residual import gemv_residual
from hetmoe.kernels.norm_gemv import norm_gemv
from hetmoe.ops import fused

HERE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
SMALL = GemvConfig(16, 32, 1, 4, 2)
"""A small K step, so the interpreter's loops take several steps at these small K."""
SPLIT = GemvConfig(32, 32, 3, 4, 2)
"""Three K shares (the last one short at K = 83), the reduce launch, two N blocks per 64."""


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the last place of `want`'s dtype at max(|got|, |want|)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[want.dtype]
    g, w = got.double(), want.double()
    top = torch.maximum(g.abs(), w.abs()).clamp(min=torch.finfo(want.dtype).tiny)
    return (g - w).abs() / torch.exp2(torch.floor(torch.log2(top)) - mantissa)


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


def check_against_torch_ops(got: torch.Tensor, x: torch.Tensor, norm: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor | None,
                            config: GemvConfig) -> None:
    """`got` = norm_gemv(x, norm, EPS, weight, bias) against the torch ops, part by part: its
    normalized x (the kernel times the identity: exact products and one-term sums) within one
    rounding of `fused.rms_norm`'s (1/rms summed in another order, and on a GPU rsqrt in another
    instruction: an element may round the other way), and `got` within one rounding of torch's
    linear of that normalized x (the same products, summed in another order)."""
    eye = torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    normalized = norm_gemv(x, norm, EPS, eye, config=config)
    assert ulps(normalized, fused.rms_norm(x, norm, EPS)).max() <= 1
    assert ulps(got, fused.linear(normalized, weight, bias)).max() <= 1


CASES = [  # (M, N, K)
    (1, 77, 83), (2, 130, 64), (3, 50, 203), (4, 17, 33), (5, 96, 160), (7, 33, 99),
    (8, 61, 147), (16, 20, 40),
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("m", "n", "k"), CASES)
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one-pass", "split-k"])
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
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["one-pass", "split-k"])
def test_gemv_residual_against_float64_and_torch(m: int, n: int, k: int,
                                                  config: GemvConfig) -> None:
    x, _, weight, bias, h = operands(m, n, k, torch.bfloat16, seed=m * 7 + k, wide=m % 2)
    plain = gemv_residual(x, weight, config=config)
    summed = gemv_residual(x, weight, h, bias if m > 4 else None, config=config)
    # the product rounded once (torch's linear), then h + it rounded again
    product = x.double() @ weight.double().T
    unit = torch.finfo(torch.bfloat16).eps
    assert ((plain.double() - product).abs() <= unit * product.abs() + 1e-30).all()
    o = fused.linear(x, weight, bias if m > 4 else None)
    assert ulps(plain, fused.linear(x, weight, None)).max() <= 1
    assert ulps(summed, h + o).max() <= 1
    if m > 4:  # the bias joins the sum before the rounding: within that rounding of the ops'
        return
    assert torch.equal(summed, h + plain)  # the epilogue's add is the residual's, bit for bit


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
        assert ulps(summed, h + fused.linear(x, weight, None)).max() <= 1
        return
    # fp32: another summation order moves the last bits; bound the error against float64
    want = h.double() + x.double() @ weight.double().T
    unit, k = torch.finfo(dtype).eps, x.shape[1]
    bound = k * unit * (x.double().abs() @ weight.double().abs().T) + 2 * unit * want.abs()
    assert ((summed.double() - want).abs() <= bound).all()


@pytest.mark.usefixtures("interpreted")
def test_default_configs_at_a_small_shape() -> None:
    x, norm, weight, bias, h = operands(2, 40, 600, torch.bfloat16, seed=9)
    check_against_torch_ops(norm_gemv(x, norm, EPS, weight), x, norm, weight, None,
                            gemv_config.NORM_GEMV_CONFIG)
    assert ulps(gemv_residual(x, weight, h), h + fused.linear(x, weight, None)).max() <= 1


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
    assert parse_gemv_config("16,512,1,4,4") == GemvConfig(16, 512, 1, 4, 4)
    assert GemvConfig(16, 256, 2, 4, 4).programs(5120) == 640
    with pytest.raises(ValueError, match="GemvConfig: block_n must be one of 16, 32, 64, 128, "
                                         "got 8"):
        GemvConfig(8, 512, 1, 4, 4)
    with pytest.raises(ValueError, match="GemvConfig: split_k must be from 1 to 16, got 0"):
        GemvConfig(16, 512, 0, 4, 4)
    with pytest.raises(ValueError, match="GemvConfig: num_stages must be from 1 to 6, got 7"):
        GemvConfig(16, 512, 1, 4, 7)
    with pytest.raises(ValueError, match=r"gemv config '16,512,1': 5 comma-separated integers "
                                         r"expected \(block_n, block_k, split_k, num_warps, "
                                         r"num_stages\)"):
        parse_gemv_config("16,512,1")


def test_the_decode_step_takes_the_kernels_by_rows_and_dtype(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert gemv_config.DECODE_GEMV_MAX_ROWS == 0  # off by default: they lost to cuBLAS
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
from hopper_compile import compile_for_hopper

from hetmoe.kernels.gemv_residual import gemv_kernel
from hetmoe.kernels.gemv_tiles import reduce_kernel
from hetmoe.kernels.norm_gemv import norm_gemv_kernel

sig = dict.fromkeys(("x_ptr", "norm_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr"), "*bf16")
sig.update(part_ptr="*fp32", M="i32", N="i32", K="i32", s_x="i32", s_w="i32", s_res="i32",
           s_out="i32", eps="fp32")
for n, k, split, warps, stages in ((16, 256, 1, 4, 4), (16, 512, 1, 4, 4), (64, 128, 4, 8, 3)):
    options = {"num_warps": warps, "num_stages": stages}
    shape = dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, SPLIT_K=split, IEEE=False)
    compile_for_hopper(norm_gemv_kernel, sig, aligned=True, options=options, BIAS=True, **shape)
    compile_for_hopper(gemv_kernel, sig, aligned=True, options=options, BIAS=False,
                       RESIDUAL=True, **shape)
compile_for_hopper(reduce_kernel, sig, aligned=True, options={"num_warps": 4}, BLOCK_M=16,
                   BLOCK_N=128, SPLIT_K=4, BIAS=True, RESIDUAL=True)
for dtype, ieee in (("fp16", False), ("fp32", True)):  # fp32: IEEE dots, odd sizes (unaligned)
    typed = {name: "*" + dtype if kind == "*bf16" else kind for name, kind in sig.items()}
    shape = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, IEEE=ieee)
    compile_for_hopper(norm_gemv_kernel, typed, BIAS=False, **shape)
    compile_for_hopper(gemv_kernel, typed, BIAS=True, RESIDUAL=False, **shape)
print("compiled")
"""


def test_the_kernels_compile_for_hopper() -> None:
    """The default shapes and split ones build for sm_90: bf16 and fp16 tensor-core dots, fp32
    IEEE dots (the interpreter above runs the IEEE branch and compiles nothing)."""
    assert_compiles_for_hopper(SHAPES_FOR_HOPPER)
