"""Gate/up projection + SiLU of routed experts on quantized activations times the packed codes
on int8 / fp8 tensor cores (`packed_moe(..., act_quant=True)`; kernels/act_quant.py).

As `moe_gate_up` (tiles of up to BM sorted rows of one expert, BN gate rows and the same BN up
rows per program, silu(gate x) * (up x) rounded once to bf16 at the rows' sorted positions),
but x arrives as codes with a scale per (token, group of G k) and the weights are never
dequantized: per group, `tl.dot` of the codes over its G / 32 halves (int8 -> exact int32, fp8
-> fp32), then acc += sum * sx[row, g] * sw[n, g] in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import _rows, group_scales, silu_mul_bf16
from hetmoe.kernels.routing_tiles import tile_rows


@triton.jit
def raw_half(base, nb, kh, NB_BYTES, FMT: tl.constexpr, NBLK: tl.constexpr):
    """The codes of half kh (32 k) of n-blocks nb [NBLK] of the int8 (FMT 1) or fp8 (FMT 3)
    matrix at byte pointer `base`, read in memory order (16-byte loads, reordered in registers
    as `dequant.codes_half`) -> [NBLK * 16, 32] int8 or float8e4nv, row b * 16 + r."""
    STEPS: tl.constexpr = 8 if FMT == 1 else 16  # int8 [8 k quads][16 n][4], fp8 [16][16][2]
    LANES: tl.constexpr = 32 // STEPS
    s = tl.arange(0, STEPS)
    c = tl.arange(0, 16 * LANES)
    off = (nb * NB_BYTES)[:, None, None] + (kh // 2) * 1024 + (kh % 2) * 512 \
        + s[None, :, None] * (16 * LANES) + c[None, None, :]
    CODE: tl.constexpr = tl.int8 if FMT == 1 else tl.float8e4nv
    return _rows(tl.load(base + off), NBLK, STEPS, LANES).to(CODE, bitcast=True)


@triton.jit
def zero_sums(BM: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr):
    """A group's [BM, BN] sums of code products before its scales: int8 int32, fp8 fp32."""
    SUM: tl.constexpr = tl.int32 if FMT == 1 else tl.float32
    return tl.zeros((BM, BN), dtype=SUM)


@triton.jit
def load_codes(ptr, FMT: tl.constexpr, mask):
    """Activation codes stored as bytes -> int8 or float8e4nv (masked lanes 0)."""
    CODE: tl.constexpr = tl.int8 if FMT == 1 else tl.float8e4nv
    return tl.load(ptr, mask=mask, other=0).to(CODE, bitcast=True)


@triton.jit
def quant_gate_up_kernel(xq_ptr, sx_ptr, packed_ptr, order_ptr, tile_expert_ptr, tile_row_ptr,
                         tile_end_ptr, act_ptr, HP, S, EXPERT_BYTES, NB_BYTES, SCALE_OFF, NUM_E,
                         TOP_K: tl.constexpr, GROUPS, G: tl.constexpr, FMT: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
    """xq [T, HP] uint8 codes, sx [T, GROUPS] fp32 (GROUPS = HP / G); packed uint8 (expert e at
    e * EXPERT_BYTES); order [T K] sorted pairs; act [T K, S] bf16 out."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t)
    if expert < NUM_E:
        rows, live, pair = tile_rows(order_ptr, tile_row_ptr, tile_end_ptr, pid_t, BM)
        token = (pair // TOP_K).to(tl.int64)
        x_rows = xq_ptr + token * HP  # [BM]
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES
        r = pid_n * BN + tl.arange(0, BN)  # rows of the group's slice (S is a multiple of 64)
        gate_nb = (pid_n * (BN // 16) + tl.arange(0, BN // 16)) * 2  # [BN / 16] n-blocks
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for grp in range(0, GROUPS):
            sum_g = zero_sums(BM, BN, FMT)
            sum_u = zero_sums(BM, BN, FMT)
            for half in tl.static_range(G // 32):
                kh = grp * (G // 32) + half
                k = kh * 32 + tl.arange(0, 32)
                xt = load_codes(x_rows[:, None] + k[None, :], FMT, live[:, None])
                wg = raw_half(base, gate_nb, kh, NB_BYTES, FMT, BN // 16)  # [BN, 32] codes
                wu = raw_half(base, gate_nb + 1, kh, NB_BYTES, FMT, BN // 16)
                sum_g = tl.dot(xt, tl.trans(wg), sum_g)  # int8: exact int32; fp8: fp32
                sum_u = tl.dot(xt, tl.trans(wu), sum_u)
            sx = tl.load(sx_ptr + token * GROUPS + grp, mask=live, other=0.0)  # [BM]
            kh0 = grp * (G // 32)
            sw_g = group_scales(base, gate_nb, kh0, NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                                True)[0]
            sw_u = group_scales(base, gate_nb + 1, kh0, NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                                True)[0]
            acc_g += sum_g.to(tl.float32) * sx[:, None] * sw_g[None, :]
            acc_u += sum_u.to(tl.float32) * sx[:, None] * sw_u[None, :]
        act = silu_mul_bf16(acc_g, acc_u)
        out = act_ptr + rows.to(tl.int64)[:, None] * S + r[None, :]
        tl.store(out, act, mask=live[:, None])
