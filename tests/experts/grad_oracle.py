"""Float64 oracle of the routed experts' backward: the packed weights dequantized exactly (no
bf16 rounding, unlike experts/packed_layout.py's unpack, which the helper is checked against)
and torch autograd over sum_j w_j * down_e(silu(gate_e x) * up_e x)."""

from __future__ import annotations

import torch

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor, padded_hidden, unpack_matrix


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _int8(raw: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    e, nb = raw.shape[0], n // 16
    block_bytes = nb * (k // 64) * 1024
    q = raw[:, :block_bytes].view(torch.int8).unflatten(1, (nb, k // 64, 16, 16, 4))
    q = q.permute(0, 1, 4, 2, 3, 5).reshape(e, n, k)
    start = _round_up(block_bytes, 64)
    scale = raw[:, start:start + nb * (k // group) * 64].view(torch.float32)
    scale = scale.unflatten(1, (nb, k // group, 16)).permute(0, 1, 3, 2).reshape(e, n, -1, 1)
    return (q.view(e, n, k // group, group).double() * scale.double()).reshape(e, n, k)


def _int4(raw: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    e, nb = raw.shape[0], n // 16
    run_k = max(64, group)
    per_run, groups_per_run, runs = run_k // 64, run_k // group, k // run_k
    run_bytes = per_run * 512 + _round_up(96 * groups_per_run, 64)
    runs_view = raw[:, :nb * runs * run_bytes].unflatten(1, (nb, runs, run_bytes))
    nibbles = runs_view[..., :per_run * 512].unflatten(-1, (per_run, 8, 16, 4))
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=4).to(torch.int8) - 8
    q = q.permute(0, 1, 5, 2, 3, 4, 6).reshape(e, n, k)
    meta = runs_view[..., per_run * 512:per_run * 512 + 96 * groups_per_run].contiguous()
    meta = meta.view(torch.bfloat16).unflatten(-1, (groups_per_run, 3, 16))
    meta = meta.permute(0, 1, 5, 2, 3, 4).reshape(e, n, k // group, 3).double()
    w = q.view(e, n, k // group, group).double() * meta[..., 0:1] + meta[..., 2:3]
    return w.reshape(e, n, k)


def unpack64(raw: torch.Tensor, fmt: str, n: int, k: int, group: int | None) -> torch.Tensor:
    """[E, n, k] float64 of one packed matrix per row of raw."""
    if fmt == "bf16":
        return unpack_matrix(raw, fmt, n, k, group).double()
    assert group is not None
    return (_int8 if fmt == "int8" else _int4)(raw, n, k, group)


def dequantized(moe: CpuMoE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 gate [E, I, H], up [E, I, H], down [E, H, I] as the packed layout holds them."""
    e, h, i = moe.num_experts, moe.hidden, moe.intermediate
    fmt, group = moe.weight_format, moe.group_size
    gates, ups, downs = [], [], []
    for part in moe.packed_groups():
        s, hp = part.end - part.begin, padded_hidden(h, group)
        if s == 0:  # a group with no slice (fewer 64-k units than groups) has no memory
            continue
        raw = host_tensor(part).view(e, part.expert_bytes)
        gu = unpack64(raw, fmt, 2 * s, hp, group)
        assert torch.equal(gu.to(torch.bfloat16), unpack_matrix(raw, fmt, 2 * s, hp, group))
        gu = gu.view(e, s // 16, 2, 16, hp).transpose(1, 2).reshape(e, 2 * s, hp)
        gates.append(gu[:, :s])
        ups.append(gu[:, s:])
        downs.append(unpack64(raw[:, part.down_offset:], fmt, _round_up(h, 16), s, group))
    gate = torch.cat(gates, 1)[:, :i, :h]
    up = torch.cat(ups, 1)[:, :i, :h]
    return gate, up, torch.cat(downs, 2)[:, :h, :i]


def reference_grads(weights3: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor,
                    dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (dx, dweights) by autograd; ids of -1 are skipped."""
    gate, up, down = weights3
    x64 = x.double().requires_grad_()
    w64 = weights.double().requires_grad_()
    out = torch.zeros_like(x64)
    for e in range(gate.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            xe = x64[tok]
            hid = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
            out = out.index_add(0, tok, (hid @ down[e].T) * w64[tok, slot][:, None])
    out.backward(dy.double())
    assert x64.grad is not None and w64.grad is not None
    return x64.grad, w64.grad


def make_call(num_experts: int, hidden: int, q: int, k: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [q, H], ids [q, k] (some -1, some duplicates), weights [q, k], dy [q, H]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(q, hidden, generator=g)
    ids = torch.randint(0, num_experts, (q, k), generator=g)
    ids[torch.rand(q, k, generator=g) < 0.15] = -1
    if q > 1 and k > 1:
        ids[1, 1] = ids[1, 0]  # the same expert twice for one token
    weights = torch.rand(q, k, generator=g)
    dy = torch.randn(q, hidden, generator=g)
    return x, ids, weights, dy


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||."""
    return float((out.double() - ref).norm() / ref.norm())
