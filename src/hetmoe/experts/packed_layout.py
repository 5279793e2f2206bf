"""The CPU backend's packed expert layout, read with torch ops on any device.

GPU prefill copies a layer's packed experts to the GPU as they lie in host memory (one copy of
the weights, in their packed bytes: INT8 moves half of BF16, INT4 a quarter) and unpacks them
there with the functions below; the layout is csrc/layout/packed_matrix.h's:

- A matrix [N, K] is n-blocks of 16 rows (N padded to 16 with zero rows); each n-block is its K
  chunks in order ("k-blocks"): bf16 16 x 32 (element (n, k) at [k/2][n][k%2]), int8 16 x 64
  ([k/4][n][k%4]), fp8 16 x 64 e4m3 codes ([k/2][n][k%2]); K is padded with zeros to a
  multiple of 64 and of the quantization group. Int8 then holds two fp32 arrays, each 64-byte
  aligned after what precedes it: scale [N/16][K/group][16] (w = scale * q) and scale * sum(q)
  (unused here); fp8 the first only (w = scale * e4m3, the checkpoint's block scales).
  Int4 is laid out in runs with inline bf16 metadata (`_unpack_int4`).
- An expert in NUMA group g is its gate/up matrix (N = 2 * slice, n-block 2j = gate rows
  16j.., 2j+1 = the same up rows; K = `padded_hidden`), then, `down_offset` bytes on, its
  down matrix (N = hidden padded to 16, K = the group's slice of the intermediate dimension).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_BLOCK_N = 16
_K_BLOCK = {"bf16": 32, "int8": 64, "fp8": 64}
_VNNI = {"bf16": 2, "int8": 4, "fp8": 2}  # k values per lane (4-byte; fp8: 2-byte) of a row


@dataclass(frozen=True)
class PackedGroup:
    """One NUMA group's mapping of a layer's packed experts (csrc/moe/moe_layer.h)."""

    address: int
    """First byte of the mapping (expert e's gate/up matrix at e * expert_bytes)."""
    bytes: int
    """Bytes of the mapping (num_experts * expert_bytes)."""
    expert_bytes: int
    """Bytes of one expert: its gate/up matrix, then its down matrix at down_offset."""
    down_offset: int
    """Offset of an expert's down matrix from its gate/up matrix."""
    begin: int
    """First intermediate row of the group's slice (padded units)."""
    end: int
    """End of the slice."""
    read_only: bool = False
    """A read-only file mapping (a converted model's layer file): never written; registered
    with the CUDA driver as read-only."""


def host_tensor(part: PackedGroup) -> torch.Tensor:
    """The group's mapping as a flat uint8 host tensor sharing its memory (no copy)."""
    buffer = (ctypes.c_uint8 * part.bytes).from_address(part.address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def padded_hidden(hidden: int, group: int | None) -> int:
    """Hp: the gate/up matrices' K, hidden zero-padded to whole 64-k blocks and groups."""
    return _round_up(hidden, max(64, group or 0))


def _unpack_int4(raw: torch.Tensor, n: int, k: int, group: int,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Int4 runs (packed_matrix.h): per n-block, runs of max(64, group) k, each its 512-byte
    blocks (the int8 block's rows r and r + 8 in the low and high nibble of byte row r, value =
    nibble - 8) then per group bf16 scale[16], scale * sum(q)[16], bias[16]; w = scale q + bias."""
    e, nb = raw.shape[0], n // _BLOCK_N
    run_k = max(64, group)
    per_run, groups_per_run, runs = run_k // 64, run_k // group, k // run_k
    blocks_bytes = per_run * 512
    run_bytes = blocks_bytes + _round_up(96 * groups_per_run, 64)
    runs_view = raw[:, :nb * runs * run_bytes].unflatten(1, (nb, runs, run_bytes))
    nibbles = runs_view[..., :blocks_bytes].unflatten(-1, (per_run, 8, _BLOCK_N, 4))
    low, high = (nibbles & 0xF), (nibbles >> 4)
    q = torch.cat((low, high), dim=4).to(torch.int8) - 8  # [E, nb, runs, per_run, 16, 16, 4]
    q = q.permute(0, 1, 5, 2, 3, 4, 6).reshape(e, n, k)  # k = (run, block, row, lane)
    meta = runs_view[..., blocks_bytes:blocks_bytes + 96 * groups_per_run]
    meta = meta.contiguous().view(torch.bfloat16).unflatten(-1, (groups_per_run, 3, _BLOCK_N))
    meta = meta.permute(0, 1, 5, 2, 3, 4).reshape(e, n, k // group, 3).to(_compute(dtype))
    w = q.view(e, n, k // group, group).to(meta.dtype) * meta[..., 0:1] + meta[..., 2:3]
    return w.reshape(e, n, k).to(dtype)


def _compute(dtype: torch.dtype) -> torch.dtype:
    """Where scale * q (+ bias) is computed: fp32 (rounded once to bf16), or float64 (exact)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unpack_matrix(raw: torch.Tensor, fmt: str, n: int, k: int, group: int | None,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """raw [E, >= matrix bytes] uint8 (each row one expert's matrix) -> [E, n, k] bf16, or
    `dtype` (float64: the exact values, no bf16 rounding of scale * q)."""
    if fmt == "int4":
        assert group is not None
        return _unpack_int4(raw, n, k, group, dtype)
    if fmt not in _K_BLOCK:
        raise ValueError(f"unpack_matrix: format {fmt!r} is not unpacked here (bf16, int8, "
                         "int4, fp8)")
    e, kb, lanes = raw.shape[0], _K_BLOCK[fmt], _VNNI[fmt]
    nb = n // _BLOCK_N
    block_bytes = nb * (k // kb) * 1024
    blocks = raw[:, :block_bytes]
    if fmt == "bf16":
        values = blocks.view(torch.bfloat16)
    elif fmt == "fp8":
        values = blocks.view(torch.float8_e4m3fn)
    else:
        values = blocks.view(torch.int8)
    # [E, nb, k/kb, kb/lanes, 16, lanes] -> [E, nb, 16, k/kb, kb/lanes, lanes] = [E, n, k]
    tiles = values.unflatten(1, (nb, k // kb, kb // lanes, _BLOCK_N, lanes))
    w = tiles.permute(0, 1, 4, 2, 3, 5).reshape(e, n, k)
    if fmt == "bf16":
        return w.to(dtype)
    assert group is not None
    start = _round_up(block_bytes, 64)
    scale = raw[:, start:start + nb * (k // group) * _BLOCK_N * 4].view(torch.float32)
    scale = scale.unflatten(1, (nb, k // group, _BLOCK_N)).permute(0, 1, 3, 2)  # [E, nb, 16, G]
    scale = scale.reshape(e, n, k // group, 1)
    w = w.view(e, n, k // group, group).to(_compute(dtype)) * scale
    return w.reshape(e, n, k).to(dtype)


def unpack_group(raw: torch.Tensor, part: PackedGroup, fmt: str, hidden: int,
                 group: int | None,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [E, expert_bytes] uint8 of one group -> (gate_up [E, 2 S, Hp] with the S gate rows
    first, down [E, Hn, S]) in bf16; S = the group's slice, Hp = `padded_hidden`, Hn = hidden
    padded to 16 (rows past H are zero); `dtype` as `unpack_matrix`'s."""
    e, s = raw.shape[0], part.end - part.begin
    hp = padded_hidden(hidden, group)
    gu = unpack_matrix(raw, fmt, 2 * s, hp, group, dtype)  # n-blocks: gate j, up j, gate j+1, ...
    gu = gu.view(e, s // _BLOCK_N, 2, _BLOCK_N, hp).transpose(1, 2).reshape(e, 2 * s, hp)
    down = unpack_matrix(raw[:, part.down_offset:], fmt, _round_up(hidden, _BLOCK_N), s, group,
                         dtype)
    return gu, down
