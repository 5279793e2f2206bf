"""`@triton.jit` helpers that read one [BN, 32] tile of a packed matrix and dequantize it in
registers (the layout of experts/packed_layout.py, csrc/layout/packed_matrix.h).

Every format's 64-k block splits into two 32-k halves that are contiguous 512-byte runs of an
n-block (bf16: one whole 32-k block of 1024 bytes), and a quantization group (>= 32) never
straddles a half: so a half needs one scale (and int4 bias) per output row, and its element
(n, k0 + j) sits at a fixed offset from the half's start:

- bf16 [j/2][n][j%2] two-byte values; int8 [j/4][n][j%4]; fp8 [j/2][n][j%2] e4m3 codes;
- int4 the int8 order over 8 byte rows, the first half in the low nibbles and the second in
  the high nibbles of the same 512 bytes (value = nibble - 8), w = scale * q + bias with the
  run's inline bf16 metadata.

Weights come out as bf16 (w rounded once, as `unpack_matrix` rounds them).
"""

from __future__ import annotations

import triton
import triton.language as tl

FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2, "fp8": 3}
"""The `FMT` constexpr of each packed format."""


@triton.jit
def dequant_half(base, nb, nr, kh, NB_BYTES, SCALE_OFF, G: tl.constexpr,
                 FMT: tl.constexpr):
    """w[nb * 16 + nr, kh * 32 + j] for j < 32 of the matrix at byte pointer `base` (uint8):
    nb, nr [BN] n-block and row in it; NB_BYTES an n-block's bytes; SCALE_OFF the byte offset
    of the fp32 scales (int8, fp8); G the group (int formats). -> [BN, 32] bf16."""
    j = tl.arange(0, 32)
    row = nb * NB_BYTES  # [BN] byte offset of each row's n-block (an expert is < 2 GiB)
    if FMT == 0:  # bf16: the 32-k block kh, two-byte values
        off = row[:, None] + kh * 1024 + (j[None, :] // 2) * 64 + nr[:, None] * 4 \
            + (j[None, :] % 2) * 2
        w = tl.load((base + off).to(tl.pointer_type(tl.bfloat16), bitcast=True))
    elif FMT == 2:  # int4: runs of RUN_K k, each its 512-byte blocks then per group metadata
        RUN_K: tl.constexpr = 64 if G < 64 else G
        META: tl.constexpr = (RUN_K // G) * 96
        RUN_BYTES: tl.constexpr = (RUN_K // 64) * 512 + (META + 63) // 64 * 64
        k0 = kh * 32
        run = k0 // RUN_K
        start = row + run * RUN_BYTES  # [BN]
        off = start[:, None] + ((k0 % RUN_K) // 64) * 512 + (j[None, :] // 4) * 64 \
            + nr[:, None] * 4 + j[None, :] % 4
        q = (tl.load(base + off) >> ((kh % 2) * 4)) & 0xF
        meta = start + (RUN_K // 64) * 512 + ((k0 % RUN_K) // G) * 96 + nr * 2  # [BN]
        scale = tl.load((base + meta).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        bias = tl.load((base + meta + 64).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        w = (q.to(tl.float32) - 8.0) * scale.to(tl.float32)[:, None] \
            + bias.to(tl.float32)[:, None]
        w = w.to(tl.bfloat16)
    else:  # int8, fp8: 1024-byte 64-k blocks, half kh % 2 of block kh // 2; fp32 group scales
        off = row[:, None] + (kh // 2) * 1024 + (kh % 2) * 512 + nr[:, None] * (
            4 if FMT == 1 else 2)
        if FMT == 1:
            off += (j[None, :] // 4) * 64 + j[None, :] % 4
            q = tl.load((base + off).to(tl.pointer_type(tl.int8), bitcast=True)).to(tl.float32)
        else:
            off += (j[None, :] // 2) * 32 + j[None, :] % 2
            q = tl.load(base + off).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        groups = NB_BYTES // (16 * G)  # k / G groups per n-block
        s_off = SCALE_OFF + ((nb * groups + (kh * 32) // G) * 16 + nr) * 4
        scale = tl.load((base + s_off).to(tl.pointer_type(tl.float32), bitcast=True))
        w = (q * scale[:, None]).to(tl.bfloat16)
    return w

