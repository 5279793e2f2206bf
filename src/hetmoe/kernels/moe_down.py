"""Down projection of routed experts on their packed bytes, weighted and summed per token.

One program takes a tile of up to BM sorted (token, slot) rows of one expert (as
`moe_gate_up`), their bf16 activations [BM, S] and BN rows of the expert's packed down matrix
(dequantized in registers), and adds routing weight * result to out[token] (fp32 atomics: a
token's top-k slots land in different tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import dequant_half, dot_bf16
from hetmoe.kernels.routing_tiles import add_weighted_rows, tile_rows


@triton.jit
def moe_down_kernel(act_ptr, packed_ptr, order_ptr, weights_ptr, tile_expert_ptr, tile_row_ptr,
                    tile_end_ptr, out_ptr, H, S, HN, EXPERT_BYTES, DOWN_OFFSET, NB_BYTES,
                    SCALE_OFF, NUM_E, TOP_K: tl.constexpr, K_BLOCKS, G: tl.constexpr,
                    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    MEM: tl.constexpr):
    """act [T K, S] bf16 at sorted positions; weights [T K] fp32 per pair; out [T, H] fp32
    (zeroed by the caller); HN = H padded to 16 (the down matrix's rows); K_BLOCKS = S / 64."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t)
    if expert < NUM_E:
        rows, live, pair = tile_rows(order_ptr, tile_row_ptr, tile_end_ptr, pid_t, BM)
        a_rows = act_ptr + rows.to(tl.int64) * S  # [BM]
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES + DOWN_OFFSET
        n = pid_n * BN + tl.arange(0, BN)
        # n-blocks past the matrix read its last one (never stored)
        nb = tl.minimum(pid_n * (BN // 16) + tl.arange(0, BN // 16), HN // 16 - 1)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K_BLOCKS):
            for half in tl.static_range(2):
                kh = kb * 2 + half
                k = kh * 32 + tl.arange(0, 32)
                at = tl.load(a_rows[:, None] + k[None, :], mask=live[:, None], other=0.0)
                w = dequant_half(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16, MEM)
                acc = dot_bf16(at, tl.trans(w), acc)
        add_weighted_rows(out_ptr, acc, weights_ptr, pair, live, n, H, TOP_K)
