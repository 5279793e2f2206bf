"""Down projection of routed experts on the quantized intermediate times the packed codes on
int8 / fp8 tensor cores, weighted and summed per token (`packed_moe(..., act_quant=True)`).

As `moe_down` (a tile of up to BM sorted rows of one expert, BN rows of its down matrix, routing
weight * result added to out[token] by fp32 atomics), but the intermediate arrives as codes with
a scale per (sorted row, group of G k) (kernels/act_quant.py quantizes `quant_gate_up`'s bf16
output) and the group sums are `quant_gate_up`'s: exact int32 (int8) or fp32 (fp8) dots, then
times sa[row, g] * sw[n, g].
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import group_scales
from hetmoe.kernels.quant_gate_up import load_codes, raw_half, zero_sums
from hetmoe.kernels.routing_tiles import add_weighted_rows, tile_rows


@triton.jit
def quant_down_kernel(aq_ptr, sa_ptr, packed_ptr, order_ptr, weights_ptr, tile_expert_ptr,
                      tile_row_ptr, tile_end_ptr, out_ptr, H, S, HN, EXPERT_BYTES, DOWN_OFFSET,
                      NB_BYTES, SCALE_OFF, NUM_E, TOP_K: tl.constexpr, GROUPS,
                      G: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """aq [T K, S] uint8 codes at sorted positions, sa [T K, GROUPS] fp32 (GROUPS = S / G);
    weights [T K] fp32 per pair; out [T, H] fp32 (zeroed by the caller); HN = H padded to 16."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_t)
    if expert < NUM_E:
        rows, live, pair = tile_rows(order_ptr, tile_row_ptr, tile_end_ptr, pid_t, BM)
        a_rows = aq_ptr + rows.to(tl.int64) * S  # [BM]
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES + DOWN_OFFSET
        n = pid_n * BN + tl.arange(0, BN)
        # n-blocks past the matrix read its last one (never stored)
        nb = tl.minimum(pid_n * (BN // 16) + tl.arange(0, BN // 16), HN // 16 - 1)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for grp in range(0, GROUPS):
            sums = zero_sums(BM, BN, FMT)
            for half in tl.static_range(G // 32):
                kh = grp * (G // 32) + half
                k = kh * 32 + tl.arange(0, 32)
                at = load_codes(a_rows[:, None] + k[None, :], FMT, live[:, None])
                w = raw_half(base, nb, kh, NB_BYTES, FMT, BN // 16)  # [BN, 32] codes
                sums = tl.dot(at, tl.trans(w), sums)
            sa = tl.load(sa_ptr + rows.to(tl.int64) * GROUPS + grp, mask=live, other=0.0)
            sw = group_scales(base, nb, grp * (G // 32), NB_BYTES, SCALE_OFF, G, FMT, BN // 16,
                              True)[0]
            acc += sums.to(tl.float32) * sa[:, None] * sw[None, :]
        add_weighted_rows(out_ptr, acc, weights_ptr, pair, live, n, H, TOP_K)
