"""Down projection of routed experts for few (token, slot) pairs, weighted and summed per token.

Decode's path beside `pair_gate_up`: one program takes one pair straight from `ids`, one of
SPLIT equal shares of its activations' k range, and BN rows of its expert's packed down matrix
(dequantized in registers), and adds routing weight * result to out[token] (fp32 atomics over
the token's K slots and the shares; the row was cleared by `pair_gate_up`). The activations are
`pair_gate_up`'s bf16 row, or (SPLIT_GU > 1) its shares' fp32 gate and up sums, added here and
put through the SiLU with the one bf16 rounding. Negative ids add nothing; an id past the
experts adds NaN to its token's row, so a bad routing shows in the output without a host sync
(the sorted path fails a device-side assert instead). SPAN > 0 takes `factored_half`'s path
and WORDS the int4 read by words as `pair_gate_up` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import codes_half, dequant_half, factored_half, silu_mul_bf16
from hetmoe.kernels.int4_words import block_words, half_sum, span_end, word_lanes
from hetmoe.kernels.pdl import start_next, wait_prior


@triton.jit
def _activations(act_ptr, pair, k, S, SPLIT_GU: tl.constexpr):
    """fp32 activations k (any shape) of `pair` (bf16 values): the bf16 row [T K, S], or
    silu(g) * u of the summed [T K, SPLIT_GU, 2S] fp32 gate/up shares, rounded to bf16."""
    if SPLIT_GU == 1:
        at = tl.load(act_ptr + pair.to(tl.int64) * S + k).to(tl.float32)
    else:
        row = act_ptr + pair.to(tl.int64) * SPLIT_GU * 2 * S + k
        g = tl.load(row)
        u = tl.load(row + S)
        for share in tl.static_range(1, SPLIT_GU):
            g += tl.load(row + share * 2 * S)
            u += tl.load(row + share * 2 * S + S)
        at = silu_mul_bf16(g, u).to(tl.float32)
    return at


@triton.jit
def pair_down_kernel(act_ptr, ids_ptr, weights_ptr, packed_ptr, out_ptr, H, S, HN, EXPERT_BYTES,
                     DOWN_OFFSET, NB_BYTES, SCALE_OFF, NUM_E, TOP_K: tl.constexpr, K_BLOCKS,
                     KU: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                     MEM: tl.constexpr, SPLIT_GU: tl.constexpr, SPAN: tl.constexpr,
                     WORDS: tl.constexpr, PDL: tl.constexpr):
    """act: `pair_gate_up`'s output for SPLIT_GU shares; ids, weights [T K] (weights any
    float, used in fp32); out [T, H] fp32; HN = H padded to 16 (the down matrix's rows). Grid
    (T K, cdiv(H, BN), SPLIT). K_BLOCKS: 64-k blocks of one share (S / 64 / SPLIT), a
    multiple of KU. SPAN, WORDS: as `pair_gate_up`'s. PDL: launched as a programmatic
    dependent (kernels/pdl.py)."""
    wait_prior(PDL)
    pair = tl.program_id(0)  # pairs on the grid's first axis: no 65,535 limit
    pid_n = tl.program_id(1)
    share = tl.program_id(2)
    expert = tl.load(ids_ptr + pair)
    n = pid_n * BN + tl.arange(0, BN)
    dst = out_ptr + (pair // TOP_K).to(tl.int64) * H + n
    if (expert >= 0) & (expert < NUM_E):
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES + DOWN_OFFSET
        # n-blocks past the matrix read its last one (never stored)
        nb = tl.minimum(pid_n * (BN // 16) + tl.arange(0, BN // 16), HN // 16 - 1)
        k0 = share * K_BLOCKS
        if WORDS:
            y = _down_words(act_ptr, pair, S, base, nb, k0, K_BLOCKS, KU, NB_BYTES, G, BN // 16,
                            SPLIT_GU, SPAN)
        else:
            y = _down_halves(act_ptr, pair, S, base, nb, k0, K_BLOCKS, KU, NB_BYTES, SCALE_OFF,
                             G, FMT, BN, MEM, SPLIT_GU, SPAN)
        start_next(PDL)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        tl.atomic_add(dst, y * weight, mask=n < H, sem="relaxed")
    elif expert >= NUM_E:
        tl.atomic_add(dst, tl.full((BN,), float("nan"), tl.float32), mask=n < H, sem="relaxed")


@triton.jit
def _down_halves(act_ptr, pair, S, base, nb, k0, K_BLOCKS, KU: tl.constexpr, NB_BYTES,
                 SCALE_OFF, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                 MEM: tl.constexpr, SPLIT_GU: tl.constexpr, SPAN: tl.constexpr):
    """The k loop over blocks [k0, k0 + K_BLOCKS) by 32-k halves (`dequant_half` or, SPAN > 0,
    `codes_half` + `factored_half`) -> [BN] fp32 sums of the rows nb hold."""
    acc = tl.zeros((BN, 32), dtype=tl.float32)  # reduced once, KU blocks a step (as gate/up)
    sums, asum = acc, tl.zeros((32,), dtype=tl.float32)  # a span's (SPAN > 0)
    for kb in range(k0, k0 + K_BLOCKS, KU):
        for j in tl.static_range(2 * KU):
            kh = kb * 2 + j
            at = _activations(act_ptr, pair, kh * 32 + tl.arange(0, 32), S, SPLIT_GU)
            if SPAN == 0:
                w = dequant_half(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16, MEM)
                acc += w.to(tl.float32) * at[None, :]
            else:
                q = codes_half(base, nb, kh, NB_BYTES, G, FMT, BN // 16, MEM)
                acc, sums, asum = factored_half(
                    acc, sums, asum, q, at, base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT,
                    BN // 16, MEM, j % SPAN == 0, j % SPAN == SPAN - 1)
    return tl.sum(acc, axis=1)


@triton.jit
def _down_words(act_ptr, pair, S, base, nb, k0, K_BLOCKS, KU: tl.constexpr, NB_BYTES,
                G: tl.constexpr, NBLK: tl.constexpr, SPLIT_GU: tl.constexpr,
                SPAN: tl.constexpr):
    """int4 by words (`int4_words`), as `pair_gate_up`'s: -> [NBLK * 16] fp32 sums of the rows
    nb hold."""
    acc = tl.zeros((NBLK, 8, 16), dtype=tl.float32)  # [b, s, n]: s summed after the loop
    sf, sa = acc, tl.zeros((1, 8, 1), dtype=tl.float32)  # a span's sums
    lanes = tl.arange(0, 8)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [8, 4]: k in a half
    for kb in range(k0, k0 + K_BLOCKS, KU):
        for ub in tl.static_range(KU):
            w = block_words(base, nb, kb + ub, NB_BYTES, G, NBLK)
            for half in tl.static_range(2):
                kh = (kb + ub) * 2 + half
                a0, a1, a2, a3 = word_lanes(
                    _activations(act_ptr, pair, kh * 32 + lanes, S, SPLIT_GU))
                if (2 * ub + half) % SPAN == 0:
                    sf, sa = tl.zeros_like(sf), tl.zeros_like(sa)
                sf = half_sum(sf, w, a0, a1, a2, a3, half)
                sa += a0 + a1 + a2 + a3
                if (2 * ub + half) % SPAN == SPAN - 1:
                    acc = span_end(acc, sf, sa, base, nb, kh, NB_BYTES, G, NBLK)
    return tl.reshape(tl.sum(acc, axis=1), (NBLK * 16,))
