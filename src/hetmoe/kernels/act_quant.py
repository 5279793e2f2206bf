"""The sorted path's tensor-core math (`packed_moe(..., act_quant=True)`, opt-in): activations
quantized per (row, k group) and multiplied by the packed codes as they lie.

int8 weights: x and the intermediate as int8 per (row, group of G k), symmetric, scale =
amax / 127; `tl.dot(int8, int8) -> int32` over a group's 32-k halves, then acc += int32 *
sx[row, g] * sw[n, g] in fp32 (the int32 sums are exact). fp8 weights: the same per (row, group
of G k) as e4m3, scale = amax / 448, `tl.dot(fp8, fp8) -> fp32` over the group (DeepSeek-V3's
1 x 128 activation tiles at G = 128; finer at smaller G). Both run at twice bf16's peak on
H100 tensor cores (on paper) from 64-row tiles (wgmma); 16-row tiles compile to mma.sync, fp8
there widened to f16 by Triton.

Error against float64 of the unquantized bf16 activations on the same bytes (measured on random
layers, tests/kernels/test_act_quant.py): int8 1.2 % (G 32) to 1.8 % (G 256) relative, fp8
3.6-4.8 %; the bf16 path's is ~0.4 % (its weights rounded to bf16). On Hopper Triton sums fp8
products in the tensor cores' reduced-precision accumulator (its default): here only over one
group (<= 256 k) before the fp32 promotion, as DeepSeek-V3's 128. The tiles, grid and routing
are `_sorted`'s: no host sync, a grid fixed by T and K (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hetmoe.experts.packed_layout import PackedGroup, padded_hidden

# The kernel modules import Triton at their top: `sorted_act_quant` imports them when it launches
# (as packed_moe, which imports this module, loads where Triton is not installed).

ACT_QUANT_FORMATS = ("int8", "fp8")
"""Packed formats whose codes the tensor cores multiply directly (bf16 has no codes; int4 is
future work: its nibbles and inline bias need their own unpack)."""

CODE_MAX = {"int8": 127.0, "fp8": 448.0}
"""Largest code magnitude per format: a group's amax maps to it (symmetric, no zero point)."""

FORMAT_CODES = {"int8": 1, "fp8": 3}
"""`dequant.FORMAT_CODES` of the formats here (the kernels' FMT)."""


def check_act_quant(fmt: str, path: str) -> None:
    """ValueError naming the format or path that `act_quant` cannot run with."""
    if fmt not in ACT_QUANT_FORMATS:
        why = "future work" if fmt == "int4" else "no codes to multiply"
        raise ValueError(f"packed_moe: act_quant needs int8 or fp8 weights, got format {fmt!r} "
                         f"({why})")
    if path == "pairs":
        raise ValueError("packed_moe: act_quant is the sorted path's math, not path='pairs' "
                         "(under 'auto', T K <= DECODE_MAX_PAIRS keeps the pair kernels)")


def quantize_rows(v: torch.Tensor, fmt: str, group: int,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v [R, C] float, zero-padded to `width` columns (a multiple of `group`), per (row, group
    of `group` columns): scale = amax / CODE_MAX, code = v / scale (int8 rounded to nearest
    even; fp8 as torch casts to e4m3). -> codes [R, width] uint8 (their bytes), scales
    [R, width / group] fp32. An all-zero group gets codes 0 and scale 0. Torch ops on v's
    device, no host sync."""
    if fmt not in CODE_MAX:
        raise ValueError(f"quantize_rows: format {fmt!r} is not one of {', '.join(CODE_MAX)}")
    rows, cols = v.shape
    if width % group or width < cols:
        raise ValueError(f"quantize_rows: width {width} is not a multiple of the group {group} "
                         f"holding the {cols} columns")
    vf = F.pad(v.float(), (0, width - cols)).view(rows, width // group, group)
    amax = vf.abs().amax(-1, keepdim=True)  # [R, groups, 1]
    scale = amax / CODE_MAX[fmt]
    q = vf / torch.where(amax > 0, scale, 1.0)
    if fmt == "int8":
        codes = q.round().clamp(-127, 127).to(torch.int8)
    else:  # |q| <= 448 but for the division's rounding; e4m3fn has no saturating cast
        codes = q.clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.view(rows, width).view(torch.uint8), scale.view(rows, width // group)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """`quantize_rows`'s result back in float64: codes [R, W] uint8, scales [R, W / G] ->
    [R, W] (the values the kernels multiply)."""
    dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    q = codes.view(dtype).double()
    rows, width = q.shape
    groups = scales.shape[1]
    return (q.view(rows, groups, width // groups) * scales.double()[..., None]).view(rows, width)


def sorted_act_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     packed: torch.Tensor, part: PackedGroup, fmt: str, hidden: int,
                     group: int | None, cfg: Any,
                     geometry: tuple[tuple[int, int], tuple[int, int]]) -> torch.Tensor:
    """`packed_moe`'s sorted path with quantized activations (arguments checked there: T K >
    0, fmt in ACT_QUANT_FORMATS, so a group in GROUPS). cfg: its `TileConfig`; geometry: its
    `matrix_geometry` of the gate/up and of the down matrix (passed in: this module sits below
    packed_moe). -> [T, H] fp32."""
    from hetmoe.kernels.quant_down import quant_down_kernel
    from hetmoe.kernels.quant_gate_up import quant_gate_up_kernel
    from hetmoe.kernels.routing_tiles import routing_tiles

    assert group is not None, "check_packed: int8 and fp8 have a group"
    t, top_k = ids.shape
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    slice_ = part.end - part.begin
    hp, hn = padded_hidden(hidden, group), -(-hidden // 16) * 16
    num_e = packed.numel() // part.expert_bytes
    tiles = routing_tiles(ids, num_e, cfg.block_m)
    # x rounded to bf16 first, as the bf16 path reads it; one quantization per token (not pair)
    xq, sx = quantize_rows(x.to(torch.bfloat16), fmt, group, hp)  # [T, Hp], [T, Hp / G]
    w = weights.reshape(-1).to(torch.float32).contiguous()
    # rows of skipped pairs stay unwritten (and their codes unread): sorted last, never live
    act = torch.empty(t * top_k, slice_, dtype=torch.bfloat16, device=x.device)
    code = FORMAT_CODES[fmt]
    nb_bytes, scale_off = geometry[0]
    grid = (slice_ // cfg.block_n_gate_up, tiles.expert.numel())
    quant_gate_up_kernel[grid](
        xq, sx, packed, tiles.order, tiles.expert, tiles.row, tiles.end, act, hp, slice_,
        part.expert_bytes, nb_bytes, scale_off, num_e, TOP_K=top_k, GROUPS=hp // group,
        G=group, FMT=code, BM=cfg.block_m, BN=cfg.block_n_gate_up, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    # A group's amax spans several gate/up programs' columns (their BN of 32 or 64 < G, or
    # groups split across programs), so torch quantizes the intermediate between the launches.
    aq, sa = quantize_rows(act, fmt, group, slice_)
    nb_bytes, scale_off = geometry[1]
    grid = (-(-hidden // cfg.block_n_down), tiles.expert.numel())
    quant_down_kernel[grid](
        aq, sa, packed, tiles.order, w, tiles.expert, tiles.row, tiles.end, out, hidden,
        slice_, hn, part.expert_bytes, part.down_offset, nb_bytes, scale_off, num_e,
        TOP_K=top_k, GROUPS=slice_ // group, G=group, FMT=code, BM=cfg.block_m,
        BN=cfg.block_n_down, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
