"""`kernels.moe_router` (the decode step's residual, norm, router and pack in one launch, or in
two without tickets) against the torch ops it replaces (ops/fused.py `rms_norm`,
`pack_moe_inputs`; ops/router.py `route`, fused form): h exactly, x within one rounding, the same
expert ids and the same weights, for each greedy router family's semantics (softmax
renormalized, rounded weights, sigmoid with a steering bias and a scale), odd expert and hidden
counts, batch 1..7, top_k 1 to E, ties; and DeepSeek-V3's biased `noaux_tc` with one group
against a float64 reference too. Both forms every time, equal bit for bit, the one launch's
tickets back at zero after each call. On the GPU when there is one, else under Triton's
interpreter (tests/kernels/conftest.py), which runs the programs one after another (a row's
blocks in order): there the last ticket's logic runs, not its race (a device test)."""

from __future__ import annotations

import pytest
import torch
from hopper_compile import assert_compiles_for_hopper

from hetmoe.kernels.moe_router import moe_router, row_tickets
from hetmoe.ops import fused
from hetmoe.ops.router import RouterConfig, route

HERE = "cuda" if torch.cuda.is_available() else "cpu"

ROUTERS = {
    "qwen3": RouterConfig(0, 0, norm_topk_prob=True, round_weights=True),
    "qwen2": RouterConfig(0, 0, round_weights=True),
    "mixtral": RouterConfig(0, 0, norm_topk_prob=True),
    "sigmoid": RouterConfig(0, 0, scoring="sigmoid", norm_topk_prob=True, scaling_factor=2.5,
                            logits_fp32=True),
    "scaled": RouterConfig(0, 0, scaling_factor=1.5, scale_when_normalized=False),
}


def separated_router(x: torch.Tensor, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router weights [E, H] whose logits for every row of x [B, H] are well apart (0.05 plus
    noise of 1e-3: several bf16 roundings), so every implementation picks the same experts:
    w_e = a_e x_mean / |x_mean|^2 + noise, with the rows of x close to their mean."""
    mean = x.double().mean(0)
    levels = torch.randperm(experts, generator=g).double() * 0.05 - 0.025 * experts
    noise = torch.randn(experts, x.shape[1], generator=g, dtype=torch.float64) * 1e-5
    return levels[:, None] * mean / mean.pow(2).sum() + noise


def case(b: int, hidden: int, experts: int, dtype: torch.dtype, seed: int
         ) -> tuple[torch.Tensor, ...]:
    """h, o [B, H] (rows alike, so one router separates them all), norm [H], router [E, H]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(hidden, generator=g)
    h = (base + 0.01 * torch.randn(b, hidden, generator=g)).to(dtype)
    o = (0.3 * base + 0.01 * torch.randn(b, hidden, generator=g)).to(dtype)
    norm = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x = fused.rms_norm(h + o, norm, 1e-6)
    return h, o, norm, separated_router(x, experts, g).to(dtype)


def both_forms(h: torch.Tensor, o: torch.Tensor, norm: torch.Tensor, router: torch.Tensor,
               bias: torch.Tensor | None, args: tuple[object, ...], **shape: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_router` on HERE in one launch (tickets of more rows than B, called twice: the second
    call starts from the zeros the first left, as a graph replay does) and in two launches, at
    the launch `shape` (block_e, num_warps, block_h; none: the default): the same bits every
    time -> (h + o, x, stage) on the CPU."""
    def call(tickets: torch.Tensor | None) -> list[torch.Tensor]:
        return [t.cpu() for t in moe_router(
            h.to(HERE), o.to(HERE), norm.to(HERE), 1e-6, router.to(HERE),
            None if bias is None else bias.to(HERE), tickets, *args, **shape)]

    tickets = row_tickets(h.shape[0] + 3, HERE)
    one, again, two = call(tickets), call(tickets), call(None)
    assert torch.equal(tickets.cpu(), torch.zeros(h.shape[0] + 3, dtype=torch.int32))
    for got, want, other in zip(one, two, again, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), "one vs two launches"
        assert torch.equal(got, other), "the second call from the tickets the first left"
    return one[0], one[1], one[2]


@pytest.mark.parametrize(("name", "b", "hidden", "experts", "top_k", "dtype", "block_e"), [
    ("qwen3", 1, 2048, 128, 8, torch.bfloat16, None),
    ("qwen2", 3, 200, 60, 4, torch.bfloat16, 8),  # blocks of 8 (the default is 1 a program)
    ("qwen2", 1, 64, 5, 5, torch.bfloat16, 8),  # top_k = E, under one block of 8
    ("mixtral", 2, 96, 8, 2, torch.float32, None),
    ("mixtral", 3, 96, 8, 8, torch.float32, 8),  # top_k = E = one block
    ("sigmoid", 5, 2500, 16, 1, torch.bfloat16, None),
    ("sigmoid", 4, 130, 12, 12, torch.float32, None),  # top_k = E, sigmoid, scaled
    ("scaled", 2, 64, 20, 6, torch.float32, None),
    ("qwen3", 7, 72, 33, 1, torch.bfloat16, 8),  # odd rows, a lone expert in the last block
])
def test_matches_the_torch_ops(name: str, b: int, hidden: int, experts: int, top_k: int,
                               dtype: torch.dtype, block_e: int | None) -> None:
    """None: the default launch shape; 8: blocks of 8 experts (fewer programs under the
    interpreter, and a last block part-filled)."""
    check_against_torch(name, b, hidden, experts, top_k, dtype,
                        **({} if block_e is None else {"block_e": block_e, "num_warps": 4}))


def check_against_torch(name: str, b: int, hidden: int, experts: int, top_k: int,
                        dtype: torch.dtype, **shape: int) -> torch.Tensor:
    """`both_forms` at the launch `shape` against the torch ops -> the stage."""
    c = RouterConfig(experts, top_k, **{k: getattr(ROUTERS[name], k) for k in (
        "scoring", "norm_topk_prob", "scaling_factor", "scale_when_normalized", "logits_fp32",
        "round_weights")})
    h, o, norm, router = case(b, hidden, experts, dtype, seed=experts + b)
    bias = torch.linspace(-0.01, 0.01, experts) if c.scoring == "sigmoid" else None
    want_h = h + o
    want_x = fused.rms_norm(want_h, norm, 1e-6)
    ids, weights = route(want_x, router, bias, c, fused=True)
    want_stage = fused.pack_moe_inputs(want_x, ids, weights)
    got_h, got_x, stage = both_forms(h, o, norm, router, bias, c.kernel_args(), **shape)
    assert torch.equal(got_h, want_h)
    # one rounding; fp32 on the GPU or at another BLOCK_H: a few (the GPU's rsqrt is
    # approximate; the mean square sums in another order)
    roundings = 4 if dtype == torch.float32 and (HERE == "cuda" or "block_h" in shape) else 1
    torch.testing.assert_close(got_x, want_x, atol=0, rtol=roundings * torch.finfo(dtype).eps)
    x, got_ids, got_weights = fused.unpack_moe_inputs(stage, b, hidden, top_k)
    assert torch.equal(x, got_x.float()), "the stage holds x as stored"
    assert torch.equal(got_ids, ids)
    eps = torch.finfo(dtype).eps if c.round_weights else 1e-6
    torch.testing.assert_close(got_weights, weights, atol=1e-7, rtol=eps)
    assert stage.shape == want_stage.shape and stage.dtype == torch.int32
    return stage


ONE_BLOCK = [dict(block_e=e, num_warps=w) for e, w in ((1, 1), (2, 8), (4, 2), (16, 4), (32, 1))]


@pytest.mark.parametrize(("name", "b", "hidden", "experts", "top_k", "dtype", "shapes",
                          "block_hs"), [
    # the decode shape: the default's 128 programs of one expert against the former default's
    # 16 of 8 (H in two chunks) and 8 of 16
    ("qwen3", 1, 2048, 128, 8, torch.bfloat16,
     [dict(block_e=8, num_warps=4, block_h=1024), dict(block_e=16, num_warps=8)], (2048,)),
    ("sigmoid", 4, 130, 12, 3, torch.float32, ONE_BLOCK, (32, 64, 256)),  # fp32 logits
    ("qwen2", 2, 72, 5, 2, torch.bfloat16, ONE_BLOCK, (16, 128)),  # E under a block of 8
])
def test_every_launch_shape_gives_the_same_values(name: str, b: int, hidden: int, experts: int,
                                                  top_k: int, dtype: torch.dtype,
                                                  shapes: list[dict[str, int]],
                                                  block_hs: tuple[int, ...]) -> None:
    """Each launch shape matches the torch ops. Each logit is one program's dot product and
    BLOCK_E / num_warps leave its order of terms alone: under the interpreter (numpy sums a
    row's lanes the same way for any block of rows) the bits equal the default shape's at every
    BLOCK_E, from 1 to past E, and num_warps (which the interpreter ignores). BLOCK_H changes
    the lanes a sum runs over: the values stay within the torch ops' tolerance. On the GPU the
    tile's layout, thus the tree of each in-program sum, follows (BLOCK_E, num_warps) too
    (their `ttgir`: warps move between the E and H axes), so there only the tolerance holds."""
    default = check_against_torch(name, b, hidden, experts, top_k, dtype)
    for shape in shapes:
        stage = check_against_torch(name, b, hidden, experts, top_k, dtype, **shape)
        if HERE == "cpu":
            assert torch.equal(stage, default), shape
    for block_h in block_hs:
        check_against_torch(name, b, hidden, experts, top_k, dtype, block_e=4, block_h=block_h)


SHAPES_FOR_HOPPER = """
from hopper_compile import compile_for_hopper

from hetmoe.kernels.moe_router import router_kernel

sig = dict.fromkeys(("h_ptr", "o_ptr", "norm_ptr", "router_ptr", "h_out_ptr", "x_out_ptr"), "*bf16")
sig.update(bias_ptr="*fp32", stage_ptr="*i32", logits_ptr="*fp32", tickets_ptr="*i32", B="i32",
           H="i32", E="i32", eps="fp32", scaling="fp32")
for block_e, num_warps, block_h in ((1, 1, 2048), (1, 8, 1024), (16, 8, 1024), (2, 2, 256)):
    compile_for_hopper(router_kernel, sig, aligned=True, options={"num_warps": num_warps},
                       BLOCK_E=block_e, BLOCK_H=block_h, LOGITS_FP32=False, K=8, ALL_E=128,
                       BLOCK_K=8, SIGMOID=False, BIAS=False, NORM=True, ROUND_WEIGHTS=True)
print("compiled")
"""


def test_the_swept_launch_shapes_compile_for_hopper() -> None:
    """The ends of bench_decode_layer.py's --router-shapes sweep build for sm_90 (the
    interpreter above runs every shape but compiles none): one expert a program, one warp, a
    tile of 16 x 1024."""
    assert_compiles_for_hopper(SHAPES_FOR_HOPPER)


def test_ties_go_to_the_lowest_id_in_both_forms() -> None:
    """A router with equal rows: every logit ties, so the K picks are experts 0..K-1 (ops/router.py
    `top_k_ids`), with equal weights 1 / K after the renormalization."""
    h, o, norm, _ = case(3, 64, 12, torch.float32, seed=1)
    router = torch.ones(12, 64) * 0.01
    c = RouterConfig(12, 5, norm_topk_prob=True)
    _, got_x, stage = both_forms(h, o, norm, router, None, c.kernel_args())
    _, got_ids, got_weights = fused.unpack_moe_inputs(stage, 3, 64, 5)
    assert torch.equal(got_ids, torch.arange(5).expand(3, 5))
    assert torch.equal(got_ids, route(got_x, router, None, c, fused=True)[0])
    torch.testing.assert_close(got_weights, torch.full((3, 5), 0.2), atol=0, rtol=1e-6)


def test_fits_every_router_no_group_limits() -> None:
    assert RouterConfig(8, 2).kernel_fits()
    assert RouterConfig(8, 2, scoring="sigmoid").kernel_fits()
    assert RouterConfig(8, 2, scoring="sigmoid", topk_method="noaux_tc").kernel_fits()
    assert not RouterConfig(8, 2, topk_method="group_limited_greedy", num_groups=4,
                            topk_groups=2).kernel_fits()
    assert not RouterConfig(256, 8, scoring="sigmoid", topk_method="noaux_tc", num_groups=8,
                            topk_groups=4).kernel_fits()  # DeepSeek-V3's own: torch ops


def float64_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                  c: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`noaux_tc` without a group limit in float64: ids [B, K] chosen by sigmoid + bias, weights
    [B, K] the unbiased sigmoid scores, renormalized, then scaled."""
    scores = (x.double() @ router.double().T).sigmoid()  # [B, E]
    ids = torch.topk(scores + bias.double(), c.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * c.scaling_factor


@pytest.mark.parametrize(("b", "hidden", "experts", "top_k", "dtype"), [
    (1, 256, 64, 8, torch.bfloat16),
    (3, 200, 20, 6, torch.float32),
])
def test_a_biased_choice_matches_the_torch_router_and_float64(b: int, hidden: int, experts: int,
                                                              top_k: int,
                                                              dtype: torch.dtype) -> None:
    """DeepSeek-V3's `noaux_tc` with one group (Kimi-K2's config): the bias steers the choice,
    the weights are the unbiased scores; the same ids and weights as ops/router.py and a
    float64 reference on the kernel's own x."""
    from transformers import DeepseekV3Config

    c = RouterConfig.from_hf(DeepseekV3Config(
        n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5))
    assert (c.topk_method, c.has_bias, c.kernel_fits()) == ("noaux_tc", True, True)
    h, o, norm, router = case(b, hidden, experts, dtype, seed=experts + b)
    # Bias levels 1 apart (scores lie in (0, 1)): the choice is the bias's order, not the scores'.
    g = torch.Generator().manual_seed(b)
    bias = torch.randperm(experts, generator=g).float()
    want_x = fused.rms_norm(h + o, norm, 1e-6)
    ids, weights = route(want_x, router, bias, c, fused=True)
    assert not torch.equal(ids, route(want_x, router, None, c, fused=True)[0])  # it steers
    got_h, got_x, stage = both_forms(h, o, norm, router, bias, c.kernel_args())
    x, got_ids, got_weights = fused.unpack_moe_inputs(stage, b, hidden, top_k)
    assert torch.equal(got_h, h + o) and torch.equal(x, got_x.float())
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_weights, weights, atol=1e-7, rtol=1e-6)
    ref_ids, ref_weights = float64_route(got_x, router, bias, c)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_weights.double(), ref_weights, atol=0, rtol=1e-5)


def test_bad_inputs_are_named() -> None:
    h, o, norm, router = case(2, 64, 8, torch.float32, seed=0)
    args = (False, True, 1.0, False, False)
    tickets = row_tickets(2, "cpu")
    with pytest.raises(ValueError, match=r"h / o \[B, H\], norm \[H\] and router \[E, H\] "
                                         r"expected, got \(2, 64\), \(2, 64\), \(63,\) and "
                                         r"\(8, 64\)"):
        moe_router(h, o, norm[:63], 1e-6, router, None, tickets, 2, *args)
    with pytest.raises(ValueError, match=r"top_k 9 of 8 experts, bias None: 1 <= top_k <= E"):
        moe_router(h, o, norm, 1e-6, router, None, tickets, 9, *args)
    with pytest.raises(ValueError, match=r"bias \(7,\): 1 <= top_k <= E and a bias of \[8\]"):
        moe_router(h, o, norm, 1e-6, router, torch.zeros(7), None, 2, *args)
    with pytest.raises(ValueError, match=r"tickets of >= 2 rows, int32 \[rows\] on cpu "
                                         r"expected \(row_tickets\), got torch.int32 \(1,\) "
                                         r"on cpu"):
        moe_router(h, o, norm, 1e-6, router, None, row_tickets(1, "cpu"), 2, *args)
    with pytest.raises(ValueError, match=r"got torch.int64 \(4,\) on cpu"):
        moe_router(h, o, norm, 1e-6, router, None, torch.zeros(4, dtype=torch.int64), 2, *args)
    for shape, found in ((dict(block_e=3), "block_e 3, num_warps 1, block_h None"),
                         (dict(block_e=0), "block_e 0, num_warps 1, block_h None"),
                         (dict(block_e=2048), "block_e 2048, num_warps 1, block_h None"),
                         (dict(num_warps=6), "block_e 1, num_warps 6, block_h None"),
                         (dict(num_warps=64), "block_e 1, num_warps 64, block_h None"),
                         (dict(block_h=96), "block_e 1, num_warps 1, block_h 96"),
                         (dict(block_h=-4), "block_e 1, num_warps 1, block_h -4")):
        with pytest.raises(ValueError, match=rf"moe_router: launch shape {found}: powers of two "
                                             r"expected \(block_e 1..1024, num_warps 1..32, "
                                             r"block_h 1..65536 or None\)"):
            moe_router(h, o, norm, 1e-6, router, None, tickets, 2, *args, **shape)
