"""Gate/up projection + SiLU of routed experts for few (token, slot) pairs, no sorting.

Decode's path (`packed_moe` with T K <= `DECODE_MAX_PAIRS`): one program takes one pair straight
from `ids`, BN rows of its expert's gate and the same BN rows of its up matrix (n-blocks 2j
and 2j + 1), dequantized in registers by `dequant_half`, and one of SPLIT equal shares of the
k loop over H. With SPLIT = 1 it writes silu(gate x) * (up x) in bf16 (fp32 products and SiLU,
one rounding, as `moe_gate_up`) at the pair's row; with SPLIT > 1 (more programs, more loads in
flight, for few pairs) each share writes its fp32 gate and up sums and `pair_down` adds the
shares and applies the SiLU. Pairs with a negative id (or one past the experts) write nothing.
SPAN > 0 (int8, int4, fp8; `PairConfig.factored`) takes `factored_half`'s path: no bf16 weight,
each row's group scale applied once per SPAN halves; WORDS (int4, `PairConfig.int4_words`) reads
each 64-k block once as words (kernels/int4_words.py) instead of each half reading its bytes.
The slot-0 programs of each token's first share also clear its output row for `pair_down`'s
atomic adds, so no separate fill runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import (
    codes_half,
    dequant_half,
    factored_half,
    silu_mul_bf16,
    to_bf16,
)
from hetmoe.kernels.int4_words import block_words, half_sum, span_end, word_lanes
from hetmoe.kernels.pdl import start_next, wait_prior


@triton.jit
def pair_gate_up_kernel(x_ptr, stride_x, ids_ptr, packed_ptr, act_ptr, out_ptr, H, S,
                        EXPERT_BYTES, NB_BYTES, SCALE_OFF, NUM_E, TOP_K: tl.constexpr,
                        K_BLOCKS, KU: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
                        BN: tl.constexpr, ZN: tl.constexpr, MEM: tl.constexpr,
                        SPLIT: tl.constexpr, SPAN: tl.constexpr, WORDS: tl.constexpr,
                        PDL: tl.constexpr):
    """x [T, H] any float (rounded to bf16 here; row stride stride_x); ids [T K] int; packed
    uint8 (expert e at e * EXPERT_BYTES); act out: [T K, S] bf16 (SPLIT 1) or [T K, SPLIT, 2S]
    fp32 gate (first S) and up sums per share; out [T, H] fp32, columns
    [pid_n ZN, pid_n ZN + ZN) of each token zeroed. Grid (T K, S / BN, SPLIT). K_BLOCKS: 64-k
    blocks of one share (Hp / 64 / SPLIT), a multiple of KU. SPAN: 0 (bf16 weights) or the
    32-k halves one group scale covers, dividing G / 32 and 2 KU. WORDS (int4, SPAN > 0): read
    the codes as words (`int4_words`). PDL: launched as a programmatic dependent
    (kernels/pdl.py)."""
    wait_prior(PDL)
    pair = tl.program_id(0)  # pairs on the grid's first axis: no 65,535 limit
    pid_n = tl.program_id(1)
    share = tl.program_id(2)
    token = pair // TOP_K
    if (pair % TOP_K == 0) & (share == 0):
        z = pid_n * ZN + tl.arange(0, ZN)
        tl.store(out_ptr + token.to(tl.int64) * H + z, tl.zeros((ZN,), tl.float32), mask=z < H)
    expert = tl.load(ids_ptr + pair)
    if (expert >= 0) & (expert < NUM_E):
        x_row = x_ptr + token.to(tl.int64) * stride_x
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES
        gate_nb = (pid_n * (BN // 16) + tl.arange(0, BN // 16)) * 2  # [BN / 16] n-blocks
        if WORDS:
            g, u = _gate_up_words(x_row, H, base, gate_nb, share * K_BLOCKS, K_BLOCKS, KU,
                                  NB_BYTES, G, BN // 16, SPAN)
        else:
            g, u = _gate_up_halves(x_row, H, base, gate_nb, share * K_BLOCKS, K_BLOCKS, KU,
                                   NB_BYTES, SCALE_OFF, G, FMT, BN, MEM, SPAN)
        start_next(PDL)
        r = pid_n * BN + tl.arange(0, BN)  # rows of the group's slice (S is a multiple of 64)
        if SPLIT == 1:
            tl.store(act_ptr + pair.to(tl.int64) * S + r, silu_mul_bf16(g, u))
        else:
            row = act_ptr + (pair.to(tl.int64) * SPLIT + share) * (2 * S)
            tl.store(row + r, g)
            tl.store(row + S + r, u)


@triton.jit
def _input(x_row, k, H):
    """x_row[k] rounded to bf16 (as torch: via fp32), 0 past H -> fp32 of k's shape."""
    return to_bf16(tl.load(x_row + k, mask=k < H, other=0.0).to(tl.float32)).to(tl.float32)


@triton.jit
def _gate_up_halves(x_row, H, base, gate_nb, k0, K_BLOCKS, KU: tl.constexpr, NB_BYTES,
                    SCALE_OFF, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                    MEM: tl.constexpr, SPAN: tl.constexpr):
    """The k loop over blocks [k0, k0 + K_BLOCKS) by 32-k halves (`dequant_half` or, SPAN > 0,
    `codes_half` + `factored_half`) -> (gate, up) [BN] fp32 sums of the rows gate_nb hold."""
    # [BN, 32] partial sums, reduced once after the loop; KU blocks a step keep 4 KU
    # half-block loads in flight (the loop is not software-pipelined without a dot)
    acc_g = tl.zeros((BN, 32), dtype=tl.float32)
    acc_u = tl.zeros((BN, 32), dtype=tl.float32)
    sums_g, sums_u = acc_g, acc_u  # a span's sums (SPAN > 0), set at its first half
    xsum_g, xsum_u = tl.zeros((32,), dtype=tl.float32), tl.zeros((32,), dtype=tl.float32)
    for kb in range(k0, k0 + K_BLOCKS, KU):
        for j in tl.static_range(2 * KU):
            kh = kb * 2 + j
            xt = _input(x_row, kh * 32 + tl.arange(0, 32), H)
            if SPAN == 0:
                wg = dequant_half(base, gate_nb, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16, MEM)
                wu = dequant_half(base, gate_nb + 1, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                                  MEM)
                acc_g += wg.to(tl.float32) * xt[None, :]
                acc_u += wu.to(tl.float32) * xt[None, :]
            else:  # span sums per matrix, the inputs' sum shared
                qg = codes_half(base, gate_nb, kh, NB_BYTES, G, FMT, BN // 16, MEM)
                qu = codes_half(base, gate_nb + 1, kh, NB_BYTES, G, FMT, BN // 16, MEM)
                acc_g, sums_g, xsum_g = factored_half(
                    acc_g, sums_g, xsum_g, qg, xt, base, gate_nb, kh, NB_BYTES, SCALE_OFF,
                    G, FMT, BN // 16, MEM, j % SPAN == 0, j % SPAN == SPAN - 1)
                acc_u, sums_u, xsum_u = factored_half(
                    acc_u, sums_u, xsum_u, qu, xt, base, gate_nb + 1, kh, NB_BYTES,
                    SCALE_OFF, G, FMT, BN // 16, MEM, j % SPAN == 0, j % SPAN == SPAN - 1)
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def _gate_up_words(x_row, H, base, gate_nb, k0, K_BLOCKS, KU: tl.constexpr, NB_BYTES,
                   G: tl.constexpr, NBLK: tl.constexpr, SPAN: tl.constexpr):
    """int4 by words (`int4_words`): the k loop over blocks [k0, k0 + K_BLOCKS), each block's
    bytes loaded once as [NBLK, 8, 16] words, x in their order, the group scales applied per
    SPAN halves -> (gate, up) [NBLK * 16] fp32 sums of the rows gate_nb hold."""
    acc_g = tl.zeros((NBLK, 8, 16), dtype=tl.float32)  # [b, s, n]: s summed after the loop
    acc_u = acc_g
    sf_g, sf_u, sx = acc_g, acc_g, tl.zeros((1, 8, 1), dtype=tl.float32)  # a span's sums
    lanes = tl.arange(0, 8)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [8, 4]: k in a half
    for kb in range(k0, k0 + K_BLOCKS, KU):
        for ub in tl.static_range(KU):
            wg = block_words(base, gate_nb, kb + ub, NB_BYTES, G, NBLK)
            wu = block_words(base, gate_nb + 1, kb + ub, NB_BYTES, G, NBLK)
            for half in tl.static_range(2):
                kh = (kb + ub) * 2 + half
                x0, x1, x2, x3 = word_lanes(_input(x_row, kh * 32 + lanes, H))
                if (2 * ub + half) % SPAN == 0:
                    sf_g, sf_u, sx = tl.zeros_like(sf_g), tl.zeros_like(sf_u), tl.zeros_like(sx)
                sf_g = half_sum(sf_g, wg, x0, x1, x2, x3, half)
                sf_u = half_sum(sf_u, wu, x0, x1, x2, x3, half)
                sx += x0 + x1 + x2 + x3
                if (2 * ub + half) % SPAN == SPAN - 1:
                    acc_g = span_end(acc_g, sf_g, sx, base, gate_nb, kh, NB_BYTES, G, NBLK)
                    acc_u = span_end(acc_u, sf_u, sx, base, gate_nb + 1, kh, NB_BYTES, G, NBLK)
    g = tl.reshape(tl.sum(acc_g, axis=1), (NBLK * 16,))
    return g, tl.reshape(tl.sum(acc_u, axis=1), (NBLK * 16,))
