"""Down projection of routed experts for few (token, slot) pairs, weighted and summed per token.

Decode's path beside `pair_gate_up`: one program takes one pair straight from `ids`, its bf16
activations [S] and BN rows of its expert's packed down matrix (dequantized in registers), and
adds routing weight * result to out[token] (fp32 atomics over the token's K slots; the row was
cleared by `pair_gate_up`). Negative ids add nothing; an id past the experts adds NaN to its
token's row, so a bad routing shows in the output without a host sync (the sorted path fails a
device-side assert instead).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import dequant_half


@triton.jit
def pair_down_kernel(act_ptr, ids_ptr, weights_ptr, packed_ptr, out_ptr, H, S, HN, EXPERT_BYTES,
                     DOWN_OFFSET, NB_BYTES, SCALE_OFF, NUM_E, TOP_K: tl.constexpr, K_BLOCKS,
                     KU: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                     MEM: tl.constexpr):
    """act [T K, S] bf16; ids, weights [T K] (weights any float, used in fp32); out [T, H]
    fp32; HN = H padded to 16 (the down matrix's rows); K_BLOCKS = S / 64, a multiple of KU."""
    pair = tl.program_id(0)  # pairs on the grid's first axis: no 65,535 limit
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair)
    n = pid_n * BN + tl.arange(0, BN)
    dst = out_ptr + (pair // TOP_K).to(tl.int64) * H + n
    if (expert >= 0) & (expert < NUM_E):
        a_row = act_ptr + pair.to(tl.int64) * S
        base = packed_ptr + expert.to(tl.int64) * EXPERT_BYTES + DOWN_OFFSET
        # n-blocks past the matrix read its last one (never stored)
        nb = tl.minimum(pid_n * (BN // 16) + tl.arange(0, BN // 16), HN // 16 - 1)
        acc = tl.zeros((BN, 32), dtype=tl.float32)  # reduced once, KU blocks a step (as gate/up)
        for kb in range(0, K_BLOCKS, KU):
            for j in tl.static_range(2 * KU):
                kh = kb * 2 + j
                at = tl.load(a_row + kh * 32 + tl.arange(0, 32)).to(tl.float32)
                w = dequant_half(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, BN // 16, MEM)
                acc += w.to(tl.float32) * at[None, :]
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        tl.atomic_add(dst, tl.sum(acc, axis=1) * weight, mask=n < H, sem="relaxed")
    elif expert >= NUM_E:
        tl.atomic_add(dst, tl.full((BN,), float("nan"), tl.float32), mask=n < H, sem="relaxed")
