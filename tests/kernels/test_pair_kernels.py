"""The pair kernels' launch shapes (`PairConfig`: rows and k shares per program, blocks a loop
step, warps) against float64 in every format: k shares of gate/up write fp32 sums that the down
kernel adds and puts through the SiLU, k shares of down add by atomics; shares and unroll capped
to what divides the loop; the factored sums and int4's read by words against float64 on the
exact weights; bad configs named; every variant compiled for sm_90 (the compiled branches the
interpreter skips). Runs on the GPU when there is one, else under Triton's
interpreter (tests/kernels/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hopper_compile import assert_compiles_for_hopper
from test_packed_moe import HERE, edge_case, exact, make_layer, reference, rel_error, routing

from hetmoe.kernels.packed_moe import factored_span, packed_moe, share_steps
from hetmoe.kernels.pair_config import (
    ONE_TOKEN_PAIR_CONFIGS,
    PAIR_CONFIGS,
    PairConfig,
    pair_config_for,
    parse_pair_config,
)

CONFIGS = [
    PairConfig(16, 2, 128, 2, 2, 2, 2),  # 2 gate/up shares: fp32 sums, the SiLU in down
    PairConfig(64, 4, 16, 4, 1, 1, 8),  # 4 shares each where the blocks allow, a block a step
    PairConfig(16, 8, 32, 3, 8, 4, 4),  # more shares and unroll than blocks: the most that fit
]

# (format, experts, hidden, intermediate, group) x launch shape: every format with gate/up
# shares and with one, gate/up loops of 2-4 64-k blocks (hidden padded inside), down loops of
# 2-3 (3: 2 shares fall back to 1, 3 run)
CASES = [
    (("bf16", 4, 200, 128, None), CONFIGS[0]), (("bf16", 4, 200, 128, None), CONFIGS[2]),
    (("int8", 4, 100, 192, 32), CONFIGS[1]), (("int8", 4, 100, 192, 32), CONFIGS[2]),
    (("int4", 4, 72, 128, 32), CONFIGS[0]), (("int4", 3, 256, 128, 128), CONFIGS[1]),
    (("fp8", 4, 128, 128, 64), CONFIGS[0]), (("fp8", 4, 128, 128, 64), CONFIGS[2]),
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("shape", "cfg"), CASES,
                         ids=["-".join(map(str, (*s, *vars(c).values()))) for s, c in CASES])
def test_every_launch_shape_equals_float64(shape: tuple, cfg: PairConfig) -> None:
    fmt, _, h, _, _ = shape
    layer, x, ids, weights = edge_case(shape, 3)
    out = packed_moe(x.to(HERE), ids.to(HERE), weights.to(HERE), layer.raw.to(HERE), layer.part,
                     fmt, h, layer.moe.group_size, path="pairs", pair_config=cfg).cpu()
    assert out.shape == (3, h) and out.dtype == torch.float32
    assert rel_error(out, reference(layer, x, ids, weights)) < 2e-3
    assert torch.equal(out[1], torch.zeros(h))  # cleared by the first share, nothing added


@pytest.mark.usefixtures("interpreted")
def test_shares_mark_an_id_past_the_experts() -> None:
    """With k shares on both kernels an id >= E still turns its token's row to NaN, and the
    other rows equal float64."""
    layer = make_layer("int8", 4, 128, 128, 64, seed=5)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    ids, weights = routing(3, 2, 4, seed=7)
    ids[2, 1] = 4
    out = packed_moe(x.to(HERE), ids.to(HERE), weights.to(HERE), layer.raw.to(HERE), layer.part,
                     "int8", 128, 64, path="pairs", pair_config=CONFIGS[0]).cpu()
    assert out[2].isnan().all()
    ids[2, 1] = -1
    assert rel_error(out[:2], reference(layer, x, ids, weights)[:2]) < 2e-3


# factored: every quantized format and group sizes 32 / 64 / 128 / 256 (spans of 1, 2, 4 halves
# and one capped by a 3-block step), gate/up and down shares of 1 and more, odd sizes padded;
# gate/up blocks of 16, 32 and 64 rows in int8 and int4 (the interpreter's time goes with the
# programs: int4's G 128 and G 256 cases take 64, a quarter of 16's; the shipped int4 shape's 16
# rows and one share run in test_packed_moe's small shapes)
FACTORED = [
    (("int8", 4, 100, 192, 32), PairConfig(16, 2, 128, 2, 2, 2, 2, True)),
    (("int8", 4, 256, 384, 128), PairConfig(32, 1, 64, 3, 4, 4, 4, True)),
    (("int8", 3, 192, 256, 64), PairConfig(64, 4, 16, 4, 1, 1, 8, True)),
    (("int4", 4, 72, 128, 32), PairConfig(32, 1, 64, 1, 4, 4, 4, True)),
    (("int4", 3, 256, 256, 128), PairConfig(64, 1, 32, 2, 3, 2, 2, True)),
    (("int4", 3, 256, 256, 256), PairConfig(64, 2, 64, 1, 4, 4, 4, True)),
    (("int4", 3, 256, 128, 32), ONE_TOKEN_PAIR_CONFIGS["int4"]),  # decode's at batch 1
    (("fp8", 4, 128, 128, 64), PairConfig(16, 8, 32, 3, 8, 4, 4, True)),
    (("fp8", 4, 256, 384, 128), PairConfig(32, 1, 64, 1, 4, 4, 4, True)),
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("shape", "cfg"), FACTORED,
                         ids=["-".join(map(str, (*s, *vars(c).values()))) for s, c in FACTORED])
def test_factored_equals_float64_of_the_exact_weights(shape: tuple, cfg: PairConfig) -> None:
    """No bf16 weight: within 1e-4 of float64 on the unrounded weights (the current kernels
    sit ~1e-3 off it, their weights' bf16 rounding), nearer than the rounded kernels are."""
    fmt, _, h, _, group = shape
    layer, x, ids, weights = edge_case(shape, 3)
    args = (x.to(HERE), ids.to(HERE), weights.to(HERE), layer.raw.to(HERE), layer.part, fmt, h,
            group)
    out = packed_moe(*args, path="pairs", pair_config=cfg).cpu()
    rounded = packed_moe(*args, path="pairs",
                         pair_config=dataclasses.replace(cfg, factored=False)).cpu()
    ref = reference(exact(layer), x, ids, weights)
    assert torch.equal(out[1], torch.zeros(h))  # a row routed nowhere
    assert rel_error(out, ref) < 1e-4
    assert rel_error(out, ref) < rel_error(rounded, ref) / 4


# int4 by words: every group size (a span of 1, 2, 4 halves, of 8 over a whole run of 4 blocks),
# gate/up shares of 1 and 2 and down shares of 1, 2 and 3, gate/up blocks of 16, 32 and 64 rows,
# hidden and slice padded inside
WORDS = [
    (("int4", 4, 72, 128, 32), PairConfig(32, 1, 64, 1, 4, 4, 4, True, True)),
    (("int4", 3, 232, 192, 64), PairConfig(16, 2, 32, 3, 2, 2, 2, True, True)),
    (("int4", 3, 256, 256, 128), PairConfig(64, 2, 64, 2, 4, 4, 4, True, True)),
    (("int4", 3, 256, 256, 256), PairConfig(32, 1, 128, 1, 4, 4, 4, True, True)),
]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("shape", "cfg"), WORDS,
                         ids=["-".join(map(str, (*s, *vars(c).values()))) for s, c in WORDS])
def test_int4_words_equal_float64_of_the_exact_weights(shape: tuple, cfg: PairConfig) -> None:
    """Each byte loaded once as part of a word, its nibbles summed as 1 + q / 16 times the
    inputs per group: near float64 on the unrounded weights (~3e-7 where no activation's bf16
    rounding flips; one flip of 512 inputs gave 3.4e-4 at G 256: sums of 1 + q / 16 carry ~5x
    the byte read's fp32 error, ~1e-6 of a projection), 4x nearer than the rounded kernels, a
    row routed nowhere zero, ids of -1 adding nothing."""
    fmt, _, h, _, group = shape
    layer, x, ids, weights = edge_case(shape, 3)
    assert (ids == -1).any()
    args = (x.to(HERE), ids.to(HERE), weights.to(HERE), layer.raw.to(HERE), layer.part, fmt, h,
            group)
    out = packed_moe(*args, path="pairs", pair_config=cfg).cpu()
    rounded = packed_moe(*args, path="pairs", pair_config=dataclasses.replace(
        cfg, factored=False, int4_words=False)).cpu()
    ref = reference(exact(layer), x, ids, weights)
    assert torch.equal(out[1], torch.zeros(h))  # a row routed nowhere
    assert rel_error(out, ref) < 5e-4
    assert rel_error(out, ref) < rel_error(rounded, ref) / 4


@pytest.mark.parametrize(("fmt", "group", "unroll", "factored", "want"), [
    ("int8", 128, 4, True, 4), ("int8", 128, 1, True, 2), ("int4", 32, 4, True, 1),
    ("fp8", 256, 3, True, 2), ("int8", 256, 4, True, 8), ("bf16", 64, 4, True, 0),
    ("int8", 128, 4, False, 0)])
def test_factored_span_stays_in_a_group_and_a_step(fmt: str, group: int, unroll: int,
                                                   factored: bool, want: int) -> None:
    cfg = PairConfig(32, 1, 64, 1, unroll, 4, 4, factored)
    assert factored_span(cfg, fmt, group, unroll) == want


@pytest.mark.parametrize(("blocks", "split", "unroll", "want"), [
    (32, 4, 4, (4, 4)), (32, 1, 4, (1, 4)), (12, 8, 4, (6, 2)), (12, 4, 4, (4, 3)),
    (3, 2, 4, (1, 3)), (1, 16, 8, (1, 1)), (12, 16, 8, (12, 1))])
def test_shares_and_unroll_are_the_most_that_divide_the_loop(
        blocks: int, split: int, unroll: int, want: tuple[int, int]) -> None:
    assert share_steps(blocks, split, unroll) == want


@pytest.mark.parametrize(("change", "message"), [
    ({"block_n_gate_up": 48}, "block_n_gate_up must be one of 16, 32, 64, got 48"),
    ({"block_n_down": 96}, "block_n_down must be one of 16, 32, 64, 128, 256, got 96"),
    ({"split_gate_up": 0}, "split_gate_up must be from 1 to 16, got 0"),
    ({"split_down": 17}, "split_down must be from 1 to 16, got 17"),
    ({"k_unroll": 9}, "k_unroll must be from 1 to 8, got 9"),
    ({"warps_down": 3}, "warps_down must be one of 1, 2, 4, 8, got 3"),
    ({"factored": 1}, "factored must be True or False, got 1"),
    ({"factored": True, "int4_words": "yes"}, "int4_words must be True or False, got 'yes'"),
    ({"int4_words": True}, r"int4_words needs factored=True \(the word read sums codes times "
                           r"inputs per group, never a bf16 weight\)"),
])
def test_a_bad_launch_shape_is_named(change: dict, message: str) -> None:
    fields = {**vars(CONFIGS[0]), **change}
    with pytest.raises(ValueError, match=f"PairConfig: {message}"):
        PairConfig(**fields)


def test_one_token_takes_its_own_shape_where_the_format_has_one() -> None:
    assert pair_config_for("int4", 1) is ONE_TOKEN_PAIR_CONFIGS["int4"]
    assert ONE_TOKEN_PAIR_CONFIGS["int4"] != PAIR_CONFIGS["int4"]
    for tokens in (2, 8):
        assert pair_config_for("int4", tokens) is PAIR_CONFIGS["int4"]
    for fmt in ("bf16", "int8", "fp8"):  # no one-token shape measured faster for these
        assert pair_config_for(fmt, 1) is PAIR_CONFIGS[fmt]


def test_a_command_line_shape_reads_as_pair_configs_writes_it() -> None:
    for cfg in [*PAIR_CONFIGS.values(), *ONE_TOKEN_PAIR_CONFIGS.values()]:
        text = ",".join(str(int(v)) for v in dataclasses.astuple(cfg))
        assert parse_pair_config(text) == cfg
    assert parse_pair_config("16,1,128,4,4,4,8") == PairConfig(16, 1, 128, 4, 4, 4, 8)
    assert parse_pair_config("32,1,64,1,4,2,4,1,1") == PairConfig(32, 1, 64, 1, 4, 2, 4,
                                                                   True, True)


@pytest.mark.parametrize(("text", "message"), [
    ("16,1,128,4,4,4", "7 to 9 comma-separated fields .block_n_gate_up, split_gate_up, "
                       "block_n_down, split_down, k_unroll, warps_gate_up, warps_down, "
                       "factored, int4_words., got 6"),
    ("16,1,128,4,4,4,8,1,0,1", "7 to 9 comma-separated fields .*got 10"),
    ("16,1,128,4,4,4,eight", "every field is an integer"),
    ("16,1,128,4,4,4,8,1,2", "factored, int4_words must be 0 or 1"),
    ("16,1,128,4,4,4,3", "PairConfig: warps_down must be one of 1, 2, 4, 8, got 3"),
    ("16,1,128,4,4,4,8,0,1", "PairConfig: int4_words needs factored=True"),
])
def test_a_bad_command_line_shape_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pair_config(text)


SCRIPT = """
from dataclasses import replace

from hopper_compile import compile_for_hopper

from hetmoe.kernels import dequant, packed_moe as pm, pair_config as pc
from hetmoe.kernels.pair_down import pair_down_kernel
from hetmoe.kernels.pair_gate_up import pair_gate_up_kernel

POINTERS = {"x_ptr": "*bf16", "ids_ptr": "*i64", "packed_ptr": "*u8", "out_ptr": "*fp32",
            "weights_ptr": "*fp32"}


def build(fn, warps, act, **consts):
    # every pointer and int 16-divisible, as the launches at the Qwen3-30B-A3B shape specialize
    types = {p.name: "*" + act if p.name == "act_ptr" else POINTERS.get(p.name, "i32")
             for p in fn.params}
    compile_for_hopper(fn, types, aligned=True, options={"num_warps": warps}, **consts)


# Hp = 2048 (32 blocks), S = 768 (12 blocks), top-8: each format's chosen shape, 4 shares, and
# factored: the chosen shape and one of 2 gate/up shares, a block a step (a span capped at 2);
# int4 both factored shapes read by words too
for fmt, code in dequant.FORMAT_CODES.items():
    mem, g = dequant.MEMORY_ORDER[fmt], 32 if fmt == "int4" else 128
    chosen = pc.PAIR_CONFIGS[fmt]
    factored = [replace(c, factored=True) for c in (chosen, pc.PairConfig(32, 2, 64, 1, 1, 4, 4))]
    words = [replace(c, int4_words=True) for c in factored] if fmt == "int4" else []
    one = [pc.ONE_TOKEN_PAIR_CONFIGS[fmt]] if fmt in pc.ONE_TOKEN_PAIR_CONFIGS else []
    for cfg in (chosen, pc.PairConfig(16, 4, 128, 4, 3, 2, 8), *factored, *words, *one):
        split, ku = pm.share_steps(32, cfg.split_gate_up, cfg.k_unroll)
        build(pair_gate_up_kernel, cfg.warps_gate_up, "bf16" if split == 1 else "fp32",
              TOP_K=8, KU=ku, G=g, FMT=code, BN=cfg.block_n_gate_up, ZN=128, MEM=mem,
              SPLIT=split, SPAN=pm.factored_span(cfg, fmt, g, ku), WORDS=cfg.int4_words)
        ku = pm.share_steps(12, cfg.split_down, cfg.k_unroll)[1]
        build(pair_down_kernel, cfg.warps_down, "bf16" if split == 1 else "fp32", TOP_K=8,
              KU=ku, G=g, FMT=code, BN=cfg.block_n_down, MEM=mem, SPLIT_GU=split,
              SPAN=pm.factored_span(cfg, fmt, g, ku), WORDS=cfg.int4_words)
print("compiled")
"""


def test_every_variant_compiles_for_hopper() -> None:
    assert_compiles_for_hopper(SCRIPT)
