"""`@triton.jit` helpers of the pair kernels' int4 read in words (`PairConfig.int4_words`).

An int4 64-k block of an n-block is 512 bytes [8 s][16 n][4 c]: byte (s, n, c) holds row n's
k = s * 4 + c in its low nibble and k = 32 + s * 4 + c in its high nibble (value = nibble - 8).
The bytes read here as the 32-bit words they lie in, [8 s][16 n] (each byte loaded once,
contiguous along n), and each word's 8 nibbles feed the two 32-k halves in registers; the
inputs are loaded in the words' order instead ([8 s] per (half, c): x is tiny at decode), and
the sums keep the s axis until after the k loop, so no weight moves between lanes.

A nibble q becomes the fp32 1 + q / 16 exactly (q in the top of the mantissa under 1.0's
exponent: a shift and a mask-or, no conversion), summed times the inputs per group (`sf`)
beside the inputs' sum (`sx`); the group's w = scale (q - 8) + bias then gives
sum w x = 16 scale sf + (bias - 24 scale) sx, applied once per row and span of halves.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hetmoe.kernels.dequant import int4_run


@triton.jit
def block_words(base, nb, kb, NB_BYTES, G: tl.constexpr, NBLK: tl.constexpr):
    """The 64-k block kb of n-blocks nb [NBLK] (byte offsets nb * NB_BYTES from uint8 `base`,
    int4 runs of group G) as it lies: -> [NBLK, 8, 16] uint32, word (b, s, n) = the block's
    bytes s * 64 + n * 4 .. + 3."""
    start, blocks, _ = int4_run(nb * NB_BYTES, kb * 2, G)
    s = tl.arange(0, 8)
    n = tl.arange(0, 16)
    # in words, not bytes: the offsets' contiguity along n lets the compiler load 16 bytes
    off = (start[:, None, None] + blocks) // 4 + s[None, :, None] * 16 + n[None, None, :]
    return tl.load(base.to(tl.pointer_type(tl.uint32), bitcast=True) + off)


@triton.jit
def nibble_ones(w, SHIFT: tl.constexpr):
    """1 + q / 16 (fp32, exact) of the nibble q at bit SHIFT of each word of w (uint32)."""
    return ((((w >> SHIFT) & 0xF) << 19) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def span_end(acc, sf, sx, base, nb, kh, NB_BYTES, G: tl.constexpr, NBLK: tl.constexpr):
    """acc [NBLK, 8, 16] fp32 plus a span's sum of w x, the span ending in half kh of
    n-blocks nb [NBLK]: sf [NBLK, 8, 16] the sum of (1 + q / 16) x over it, sx [1, 8, 1] the
    inputs' sum; the group's scale and bias per row from the run's inline bf16 metadata."""
    meta = int4_run(nb * NB_BYTES, kh, G)[2][:, None, None] // 2 \
        + tl.arange(0, 16)[None, None, :]  # [NBLK, 1, 16] bf16 offsets: contiguous along n
    halves = base.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    scale = tl.load(halves + meta)
    bias = tl.load(halves + meta + 32)
    scale = scale.to(tl.float32)
    return acc + sf * (scale * 16.0) + sx * (bias.to(tl.float32) - scale * 24.0)


@triton.jit
def half_sum(sf, w, x0, x1, x2, x3, HALF: tl.constexpr):
    """sf [NBLK, 8, 16] + (1 + q / 16) x over one half of the words w [NBLK, 8, 16] (HALF 0:
    their low nibbles, 1: their high ones); x0..x3 [1, 8, 1] the half's inputs s * 4 + c."""
    sf += nibble_ones(w, HALF * 4) * x0
    sf += nibble_ones(w, HALF * 4 + 8) * x1
    sf += nibble_ones(w, HALF * 4 + 16) * x2
    sf += nibble_ones(w, HALF * 4 + 24) * x3
    return sf


@triton.jit
def word_lanes(v):
    """v [8, 4] (a half's inputs, v[s, c] = k s * 4 + c) -> its columns c = 0..3 as four
    [1, 8, 1] tensors, to multiply the nibbles of byte c of the words [NBLK, 8, 16]."""
    even, odd = tl.split(tl.reshape(v, (8, 2, 2)))  # [8, 2]: c = 0, 2 and c = 1, 3
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0[None, :, None], v1[None, :, None], v2[None, :, None], v3[None, :, None]
