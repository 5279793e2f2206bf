"""Gate/up projection + SiLU of routed experts on their packed bytes, rows grouped by expert.

One program computes a tile of up to BM (token, slot) rows routed to one expert (`tile_*`
arrays, built on the GPU by `kernels/routing_tiles.py`) times BN rows of the expert's gate and
the same BN rows of its up matrix (n-blocks 2j and 2j + 1 of the packed gate/up matrix),
dequantizing the weights in registers, and writes silu(gate x) * (up x) in bf16 (fp32
accumulation and SiLU, one rounding, as the CPU kernels) at the rows' sorted positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import dequant_half, dot_bf16, silu_mul_bf16
from hetmoe.kernels.routing_tiles import tile_rows


@triton.jit
def moe_gate_up_kernel(x_ptr, stride_x, packed_ptr, order_ptr, tile_expert_ptr, tile_row_ptr,
                       tile_end_ptr, act_ptr, H, S, EXPERT_BYTES, NB_BYTES, SCALE_OFF, NUM_E,
                       TOP_K: tl.constexpr, K_BLOCKS, G: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr,
                       MEM: tl.constexpr):
    """x [T, H] bf16 (row stride stride_x); packed uint8 (expert e at e * EXPERT_BYTES); order
    [T K] sorted (token, slot) pairs; act [T K, S] bf16 out. K_BLOCKS: 64-k blocks of Hp."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t)
    if expert < NUM_E:
        rows, live, pair = tile_rows(order_ptr, tile_row_ptr, tile_end_ptr, pid_t, BM)
        x_rows = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x  # [BM]
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES
        r = pid_n * BN + tl.arange(0, BN)  # rows of the group's slice (S is a multiple of 64)
        gate_nb = (pid_n * (BN // 16) + tl.arange(0, BN // 16)) * 2  # [BN / 16] n-blocks
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            for half in tl.static_range(2):
                kh = kb * 2 + half
                k = kh * 32 + tl.arange(0, 32)
                xt = tl.load(x_rows[:, None] + k[None, :],
                             mask=live[:, None] & (k[None, :] < H), other=0.0)
                wg = dequant_half(base, gate_nb, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                                  MEM)
                wu = dequant_half(base, gate_nb + 1, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                                  MEM)
                acc_g = dot_bf16(xt, tl.trans(wg), acc_g)
                acc_u = dot_bf16(xt, tl.trans(wu), acc_u)
        act = silu_mul_bf16(acc_g, acc_u)
        out = act_ptr + rows.to(tl.int64)[:, None] * S + r[None, :]
        tl.store(out, act, mask=live[:, None])
