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

Weights come out as bf16 (w rounded once, as `unpack_matrix` rounds them), or in parts for the
pair kernels' factored path (`codes_half`, `group_scales`, `factored_half`): codes times
inputs summed in fp32 over a span of halves of one group, its scale applied once per row.
Also the rounding every kernel shares: `to_bf16`, `to_dtype` (fp32 to a kernel's dtype), and
the two recipes built on them, `rms_scale` (RMSNorm) and `silu_mul_bf16` (SwiGLU).
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
"""Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 when this module is
first imported, as the kernel tests set without a GPU). The interpreter truncates fp32 -> bf16
and multiplies bf16 dot operands as raw bits: under it `to_bf16` rounds on the bits and
`dot_bf16` multiplies in fp32 (same values: bf16 products are exact in fp32). Compiled kernels
take the plain branches."""

FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2, "fp8": 3}
"""The `FMT` constexpr of each packed format."""


MEMORY_ORDER = {"bf16": False, "int8": True, "int4": False, "fp8": True}
"""Per format: read each half in its memory order (16-byte loads) and reorder the values in
registers, or load each value (or int4 byte) from its own address. Measured on an H100
(docs/benchmarks/gpu_kernels.md): the reorder costs bf16 2.5x at 4096 tokens (up to 2.7x in
decode) and int4 1.1-1.45x in decode, and saves int8 1-17 % and fp8 27-33 % in decode."""


@triton.jit
def to_bf16(v):
    """fp32 -> bf16, rounded to nearest even (NaN aside) as torch and the GPU round."""
    if INTERPRETED:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        v = u.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def to_dtype(v, dtype: tl.constexpr):
    """fp32 -> `dtype` (bf16, fp16, fp32), rounded to nearest: bf16 by `to_bf16`, so on the bits
    under the interpreter too."""
    if dtype == tl.bfloat16:
        return to_bf16(v)
    return v.to(dtype)


@triton.jit
def rms_scale(x, inv, w, dtype: tl.constexpr):
    """RMSNorm's output from fp32 x, its 1 / rms `inv` and weights w (fp32, broadcastable):
    x * inv rounded to `dtype`, times w, rounded to `dtype` (ops/fused.py `rms_norm`) -> fp32."""
    return to_dtype(to_dtype(x * inv, dtype).to(tl.float32) * w, dtype).to(tl.float32)


@triton.jit
def silu_mul_bf16(g, u):
    """silu(g) * u of fp32 gate / up values, in fp32, rounded once to bf16."""
    return to_bf16(g / (1.0 + tl.exp(-g)) * u)


@triton.jit
def dot_bf16(a, b, acc):
    """acc + a @ b of bf16 tiles, fp32 accumulation."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _rows(raw, NBLK: tl.constexpr, STEPS: tl.constexpr, LANES: tl.constexpr):
    """[NBLK, STEPS, 16 * LANES] in memory order ([k step][n][k lane] per n-block) ->
    [NBLK * 16, STEPS * LANES]: row n, column k."""
    t = tl.reshape(raw, (NBLK, STEPS, 16, LANES))
    t = tl.permute(t, (0, 2, 1, 3))
    return tl.reshape(t, (NBLK * 16, STEPS * LANES))


@triton.jit
def dequant_half(base, nb, kh, NB_BYTES, SCALE_OFF, G: tl.constexpr, FMT: tl.constexpr,
                 NBLK: tl.constexpr, MEM: tl.constexpr):
    """w[nb[b] * 16 + r, kh * 32 + j] for b < NBLK, r < 16, j < 32 of the matrix at byte
    pointer `base` (uint8): nb [NBLK] n-block indices; NB_BYTES an n-block's bytes; SCALE_OFF
    the byte offset of the fp32 scales (int8, fp8); G the group (int formats); MEM: read in
    memory order (else gathered). -> [NBLK * 16, 32] bf16, row b * 16 + r."""
    q = codes_half(base, nb, kh, NB_BYTES, G, FMT, NBLK, MEM)
    if FMT == 0:
        return q
    scale, bias = group_scales(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, NBLK, MEM)
    if FMT == 2:
        return to_bf16(q * scale[:, None] + bias[:, None])
    return to_bf16(q * scale[:, None])


@triton.jit
def codes_half(base, nb, kh, NB_BYTES, G: tl.constexpr, FMT: tl.constexpr, NBLK: tl.constexpr,
               MEM: tl.constexpr):
    """The half's values before their group's scale (arguments as `dequant_half`): bf16 the
    weights themselves (bf16); int8 q, int4 nibble - 8, fp8 the e4m3 code's value (fp32, exact).
    -> [NBLK * 16, 32], row b * 16 + r."""
    if not MEM:
        nbr, nr = _gather_rows(nb, NBLK)
        return _gather_codes(base, nbr, nr, kh, NB_BYTES, G, FMT)
    row = nb * NB_BYTES  # [NBLK] byte offset of each n-block (an expert is < 2 GiB)
    if FMT == 0:  # bf16: the 32-k block kh, [16 k pairs][16 n][2] two-byte values
        s = tl.arange(0, 16)
        c = tl.arange(0, 32)
        off = row[:, None, None] + kh * 1024 + s[None, :, None] * 64 + c[None, None, :] * 2
        q = _rows(tl.load((base + off).to(tl.pointer_type(tl.bfloat16), bitcast=True)),
                  NBLK, 16, 2)
    elif FMT == 2:  # int4: runs of RUN_K k, each its 512-byte blocks then per group metadata
        start, blocks, _ = int4_run(row, kh, G)
        s = tl.arange(0, 8)
        c = tl.arange(0, 64)
        off = start[:, None, None] + blocks + s[None, :, None] * 64 + c[None, None, :]
        q = _rows((tl.load(base + off) >> ((kh % 2) * 4)) & 0xF, NBLK, 8, 4)
        q = q.to(tl.float32) - 8.0
    else:  # int8 [8 k quads][16 n][4], fp8 [16 k pairs][16 n][2]: half kh % 2 of block kh // 2
        STEPS: tl.constexpr = 8 if FMT == 1 else 16
        s = tl.arange(0, STEPS)
        c = tl.arange(0, 64 if FMT == 1 else 32)
        off = row[:, None, None] + (kh // 2) * 1024 + (kh % 2) * 512 \
            + s[None, :, None] * (1024 // STEPS // 2) + c[None, None, :]
        if FMT == 1:
            q = tl.load((base + off).to(tl.pointer_type(tl.int8), bitcast=True))
            q = _rows(q, NBLK, 8, 4).to(tl.float32)
        else:
            q = _rows(tl.load(base + off), NBLK, 16, 2)
            q = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return q


@triton.jit
def group_scales(base, nb, kh, NB_BYTES, SCALE_OFF, G: tl.constexpr, FMT: tl.constexpr,
                 NBLK: tl.constexpr, MEM: tl.constexpr):
    """(scale, bias) [NBLK * 16] fp32 of the group holding half kh, per row b * 16 + r: w =
    scale * `codes_half` + bias (bias 0 but for int4; int8, int4, fp8 only)."""
    r = tl.arange(0, 16)
    if not MEM:
        nbr, nr = _gather_rows(nb, NBLK)
        return _gather_scales(base, nbr, nr, kh, NB_BYTES, SCALE_OFF, G, FMT)
    if FMT == 2:
        meta = int4_run(nb * NB_BYTES, kh, G)[2][:, None] + r[None, :] * 2  # [NBLK, 16]
        scale = tl.load((base + meta).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        bias = tl.load((base + meta + 64).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        scale = tl.reshape(scale.to(tl.float32), (NBLK * 16,))
        bias = tl.reshape(bias.to(tl.float32), (NBLK * 16,))
    else:
        groups = NB_BYTES // (16 * G)  # k / G groups per n-block
        s_off = SCALE_OFF + ((nb[:, None] * groups + (kh * 32) // G) * 16 + r[None, :]) * 4
        scale = tl.load((base + s_off).to(tl.pointer_type(tl.float32), bitcast=True))
        scale = tl.reshape(scale, (NBLK * 16,))
        bias = tl.zeros_like(scale)
    return scale, bias


@triton.jit
def factored_half(acc, sums, xsum, q, xt, base, nb, kh, NB_BYTES, SCALE_OFF, G: tl.constexpr,
                  FMT: tl.constexpr, NBLK: tl.constexpr, MEM: tl.constexpr, FIRST: tl.constexpr,
                  LAST: tl.constexpr):
    """One half of a span (halves of one group, FIRST and LAST its ends) into acc [BN, 32]
    without a bf16 weight: sums += q xt and xsum += xt over the span, then at LAST acc +=
    scale * sums (+ int4: bias * xsum). A one-half span takes w = scale q + bias in fp32 per
    weight instead (2 FMAs a weight, not 3). q: `codes_half` [BN, 32] fp32; xt [32] fp32.
    -> (acc, sums, xsum)."""
    if FIRST and LAST:
        scale, bias = group_scales(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, NBLK, MEM)
        if FMT == 2:
            acc += (q * scale[:, None] + bias[:, None]) * xt[None, :]
        else:
            acc += (q * scale[:, None]) * xt[None, :]
        return acc, sums, xsum
    if FIRST:
        sums = q * xt[None, :]
        xsum = xt
    else:
        sums += q * xt[None, :]
        xsum += xt
    if LAST:
        scale, bias = group_scales(base, nb, kh, NB_BYTES, SCALE_OFF, G, FMT, NBLK, MEM)
        acc += sums * scale[:, None]
        if FMT == 2:
            acc += bias[:, None] * xsum[None, :]
    return acc, sums, xsum


@triton.jit
def int4_run(row, kh, G: tl.constexpr):
    """Where half kh of int4 n-blocks starting at byte offsets `row` sits: (its run's start,
    byte offset of its 512-byte block in the run, start of its group's metadata)."""
    RUN_K: tl.constexpr = 64 if G < 64 else G  # runs of RUN_K k: blocks, then group metadata
    META: tl.constexpr = (RUN_K // G) * 96
    RUN_BYTES: tl.constexpr = (RUN_K // 64) * 512 + (META + 63) // 64 * 64
    k0 = kh * 32
    start = row + (k0 // RUN_K) * RUN_BYTES
    return start, ((k0 % RUN_K) // 64) * 512, \
        start + (RUN_K // 64) * 512 + ((k0 % RUN_K) // G) * 96


@triton.jit
def _gather_rows(nb, NBLK: tl.constexpr):
    """nb [NBLK] n-blocks -> (n-block, row in it) [NBLK * 16] of rows b * 16 + r."""
    r = tl.arange(0, 16)
    nbr = tl.reshape(tl.broadcast_to(nb[:, None], (NBLK, 16)), (NBLK * 16,))
    nr = tl.reshape(tl.broadcast_to(r[None, :], (NBLK, 16)), (NBLK * 16,))
    return nbr, nr


@triton.jit
def _gather_codes(base, nb, nr, kh, NB_BYTES, G: tl.constexpr, FMT: tl.constexpr):
    """`codes_half` of rows nb * 16 + nr (nb, nr [BN]), each value loaded from its own address
    (int4: its byte). -> [BN, 32]."""
    j = tl.arange(0, 32)
    row = nb * NB_BYTES  # [BN] byte offset of each row's n-block (an expert is < 2 GiB)
    if FMT == 0:  # bf16: the 32-k block kh, two-byte values
        off = row[:, None] + kh * 1024 + (j[None, :] // 2) * 64 + nr[:, None] * 4 \
            + (j[None, :] % 2) * 2
        q = tl.load((base + off).to(tl.pointer_type(tl.bfloat16), bitcast=True))
    elif FMT == 2:  # int4: runs of RUN_K k, each its 512-byte blocks then per group metadata
        start, blocks, _ = int4_run(row, kh, G)
        off = start[:, None] + blocks + (j[None, :] // 4) * 64 + nr[:, None] * 4 + j[None, :] % 4
        q = ((tl.load(base + off) >> ((kh % 2) * 4)) & 0xF).to(tl.float32) - 8.0
    else:  # int8, fp8: 1024-byte 64-k blocks, half kh % 2 of block kh // 2
        off = row[:, None] + (kh // 2) * 1024 + (kh % 2) * 512 + nr[:, None] * (
            4 if FMT == 1 else 2)
        if FMT == 1:
            off += (j[None, :] // 4) * 64 + j[None, :] % 4
            q = tl.load((base + off).to(tl.pointer_type(tl.int8), bitcast=True)).to(tl.float32)
        else:
            off += (j[None, :] // 2) * 32 + j[None, :] % 2
            q = tl.load(base + off).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return q


@triton.jit
def _gather_scales(base, nb, nr, kh, NB_BYTES, SCALE_OFF, G: tl.constexpr, FMT: tl.constexpr):
    """`group_scales` of rows nb * 16 + nr (nb, nr [BN]). -> (scale, bias) [BN] fp32."""
    if FMT == 2:
        meta = int4_run(nb * NB_BYTES, kh, G)[2] + nr * 2  # [BN]
        scale = tl.load((base + meta).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        bias = tl.load((base + meta + 64).to(tl.pointer_type(tl.bfloat16), bitcast=True))
        scale, bias = scale.to(tl.float32), bias.to(tl.float32)
    else:  # fp32 group scales after the blocks
        groups = NB_BYTES // (16 * G)  # k / G groups per n-block
        s_off = SCALE_OFF + ((nb * groups + (kh * 32) // G) * 16 + nr) * 4
        scale = tl.load((base + s_off).to(tl.pointer_type(tl.float32), bitcast=True))
        bias = tl.zeros_like(scale)
    return scale, bias
