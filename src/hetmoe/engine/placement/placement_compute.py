"""Resident experts computed on the GPU straight from their packed bytes.

`packed_pairs(x, ids, weights, packed, part, fmt, hidden, group) -> [T, H] fp32` is one NUMA
group's share of out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t) over the experts
held back to back in `packed` (the CPU backend's layout, experts/packed_layout.py), e = ids[t, j]
an index into `packed` (-1: skipped). On CUDA it is `hetmoe.kernels.packed_moe` where that
kernel runs (`use_kernel`); else torch: only the (token, slot) pairs' experts are gathered and
unpacked (few pairs at decode), so the call has fixed shapes and a CUDA graph can capture it.
`packed_all` serves long inputs (prefill): every slot unpacked once and a grouped GEMM over the
rows (experts/routed_mlp.py). `packed_slots` picks between them for a set of slots (a layer's
resident experts, or the staging pool's fetched ones).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hetmoe.experts.packed_layout import PackedGroup, unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp
from hetmoe.kernels.packed_moe import packed_moe
from hetmoe.kernels.prefill_path import unpack_reason


@functools.cache
def use_kernel(device: torch.device, fmt: str) -> bool:
    """Whether `hetmoe.kernels.packed_moe` computes `fmt` experts on `device` (a CUDA GPU it
    supports, and HETMOE_GPU_EXPERTS=packed, the default), as GPU prefill decides."""
    return not unpack_reason(device, fmt)


def packed_pairs_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       packed: torch.Tensor, part: PackedGroup, fmt: str, hidden: int,
                       group: int | None) -> torch.Tensor:
    """x [T, H], ids [T, K] (index into packed, -1 skip), weights [T, K] -> [T, H] fp32, in
    torch (see the module docstring). As the CPU kernels: bf16 inputs, fp32 SiLU, the
    intermediate rounded to bf16 once."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # [P] pairs
    rows = packed.view(-1, part.expert_bytes)[flat.clamp(min=0)]  # [P, expert_bytes]
    gate_up, down = unpack_group(rows, part, fmt, hidden, group)  # [P, 2S, Hp], [P, Hn, S]
    s, hp = down.shape[2], gate_up.shape[2]
    # fp32 products of bf16 values: a bf16 bmm would round h and y to bf16 as well.
    xs = F.pad(x.to(torch.bfloat16), (0, hp - x.shape[1])).float()  # [T, Hp]
    xs = xs[:, None].expand(t, k, hp).reshape(t * k, hp, 1)  # [P, Hp, 1]
    h = torch.bmm(gate_up.float(), xs)[..., 0]  # [P, 2S]
    a = (F.silu(h[:, :s]) * h[:, s:]).to(torch.bfloat16).float()  # [P, S]
    y = torch.bmm(down.float(), a[..., None])[:, :x.shape[1], 0]  # [P, H]
    scale = torch.where(flat >= 0, weights.reshape(-1).float(), 0.0)  # skipped pairs weigh 0
    return (y * scale[:, None]).view(t, k, -1).sum(1)


def packed_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 packed: torch.Tensor, part: PackedGroup, fmt: str, hidden: int,
                 group: int | None, act_quant: bool = False) -> torch.Tensor:
    """`packed_pairs_torch`'s result, by the Triton kernel where `use_kernel`; `act_quant`:
    the kernel's sorted path on int8 / fp8 tensor cores (HETMOE_GPU_EXPERT_MATH=quantized,
    read once by the runner; the torch path ignores it)."""
    if use_kernel(x.device, fmt):
        return packed_moe(x, ids, weights.float(), packed, part, fmt, hidden, group,
                          act_quant=act_quant)
    return packed_pairs_torch(x, ids, weights, packed, part, fmt, hidden, group)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def packed_slots(x: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor,
                 weights: torch.Tensor, packed: Sequence[torch.Tensor],
                 parts: Sequence[PackedGroup], fmt: str, hidden: int, group: int | None,
                 table: torch.Tensor, act_quant: bool = False) -> torch.Tensor:
    """x [T, H], expert ids and their slots [T, K] (-1: not here) in `packed` (per NUMA group,
    slots back to back; table [E]: expert -> slot or -1), weights [T, K] -> [T, H] fp32 of the
    pairs that have a slot; `act_quant` as `packed_pairs`'."""
    slots = packed[0].numel() // parts[0].expert_bytes
    # The torch path gathers each pair's expert: past `slots` pairs unpacking every slot
    # once is cheaper (the kernel reads each expert once at any length).
    torch_path = not use_kernel(x.device, fmt)
    if torch_path and slot.numel() > slots and not capturing(x.device):
        return packed_all(x, ids, torch.where(slot >= 0, weights, 0.0), packed, parts, fmt,
                          hidden, group, table)
    out: torch.Tensor | None = None
    for data, part in zip(packed, parts, strict=True):
        y = packed_pairs(x, slot, weights, data, part, fmt, hidden, group, act_quant)
        out = y if out is None else out + y
    assert out is not None
    return out


def packed_all(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               packed: Sequence[torch.Tensor], parts: Sequence[PackedGroup], fmt: str,
               hidden: int, group: int | None, table: torch.Tensor) -> torch.Tensor:
    """Long inputs: x [T, H], ids [T, K] expert ids, table [E] slot or -1 -> [T, H] fp32 of
    the resident experts' pairs (every slot unpacked once, then a grouped GEMM)."""
    unpacked = [unpack_group(p.view(-1, part.expert_bytes), part, fmt, hidden, group)
                for p, part in zip(packed, parts, strict=True)]
    grouped = grouped_mm_available(x.device)
    return routed_mlp(x, ids, weights, unpacked, grouped, local=table).float()
