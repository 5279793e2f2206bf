"""A layer's (token, slot) pairs grouped by expert into row tiles, on the GPU with no host sync.

The expert kernels (`moe_gate_up`, `moe_down`) run one program per (tile, column block); a
tile is up to `block_m` consecutive sorted pairs of one expert. The grid is fixed by T and K
alone (`max_tiles`): every shape here is bounded by T * K, never read back to the host, so a
CUDA graph can capture the whole computation. `tile_rows` is the kernels' read of one tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RoutingTiles:
    """Sorted pairs and their tiles (int32 tensors on the ids' device)."""

    order: torch.Tensor
    """[T K] pair indices (token * K + slot) sorted by expert; skipped pairs (-1) last."""
    expert: torch.Tensor
    """[max_tiles] each tile's expert; `num_experts` for the unused tiles past the last."""
    row: torch.Tensor
    """[max_tiles] each tile's first position in `order`."""
    end: torch.Tensor
    """[max_tiles] the end of its expert's positions in `order` (a tile stops there)."""


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the grid holds: each expert's last tile may be partial, and no tile is empty."""
    return max(1, min(pairs, -(-pairs // block_m) + num_experts))


def routing_tiles(ids: torch.Tensor, num_experts: int, block_m: int) -> RoutingTiles:
    """ids [T, K] (expert index in [0, num_experts), -1 = skip) -> tiles of `block_m` rows.
    An id >= num_experts fails a device-side assert (checked without a host sync)."""
    flat = ids.reshape(-1).long()  # [P]
    torch._assert_async((flat < num_experts).all())
    key = torch.where(flat >= 0, flat, num_experts)  # skipped pairs sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # bincount would sync for its length
    ends = counts.cumsum(0)
    starts = ends - counts
    tiles = (counts[:num_experts] + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)  # [E]
    i = torch.arange(max_tiles(flat.numel(), num_experts, block_m), device=ids.device)
    expert = torch.searchsorted(tile_ends, i, right=True)  # [NT] in [0, E]
    valid = expert.clamp(max=num_experts - 1)
    row = starts[valid] + (i - (tile_ends[valid] - tiles[valid])) * block_m
    return RoutingTiles(order.int(), expert.int(), row.int(), ends[valid].int())


@triton.jit
def tile_rows(order_ptr, tile_row_ptr, tile_end_ptr, tile, BM: tl.constexpr):
    """Tile `tile` of a `RoutingTiles` (its expert already checked live): its BM positions in
    `order` [BM], which of them are its expert's (`live`: a tile stops at the expert's end) and
    the (token * K + slot) pair at each (0 where not live)."""
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    rows = row0 + tl.arange(0, BM)
    live = rows < row_end
    pair = tl.load(order_ptr + rows, mask=live, other=0)
    return rows, live, pair


@triton.jit
def add_weighted_rows(out_ptr, acc, weights_ptr, pair, live, n, H, TOP_K: tl.constexpr):
    """The down kernels' end: out [T, H] fp32 at each live pair's token and columns n < H +=
    acc [BM, BN] times the pair's routing weight (weights [T K] fp32), by relaxed atomics (the
    K pairs of a token add into one row)."""
    weight = tl.load(weights_ptr + pair, mask=live, other=0.0)
    token = (pair // TOP_K).to(tl.int64)
    dst = out_ptr + token[:, None] * H + n[None, :]
    tl.atomic_add(dst, acc * weight[:, None], mask=live[:, None] & (n[None, :] < H),
                  sem="relaxed")
