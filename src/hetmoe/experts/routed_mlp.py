"""Routed experts of one layer in torch: the (token, slot) pairs grouped by expert, each expert's
rows computed, the weighted rows summed back per token. The torch backend (`TorchExperts`, model
dtype, any activation) and the GPU prefill (`routed_mlp`, unpacked packed weights) both run it.

out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t), e = ids[t, j]. `routed_mlp` sums
over the NUMA groups' slices of the intermediate dimension (each a `packed_layout.unpack_group`
result); its rows are one matrix product per projection and expert: `torch._grouped_mm` on GPUs
that have it (sm90+, one launch for all experts), else a loop over the experts that got rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]
"""(expert, its rows of x [m, H]) -> [m, H_out]: one expert's MLP on the rows routed to it."""


@dataclass(frozen=True)
class ExpertRows:
    """The (token, slot) pairs computed here, sorted by expert (stable: token order within)."""

    pair: torch.Tensor
    """[R] int64 into the flattened [T K] picks."""
    token: torch.Tensor
    """[R] int64: each pair's token (pair // K)."""
    counts: torch.Tensor
    """[P] int64: rows per expert, in expert order."""

    def bounds(self) -> list[int]:
        """Row offsets of each expert's rows, [P + 1] (reads the counts back: one sync)."""
        return [0, *self.counts.cumsum(0).tolist()]


def expert_rows(ids: torch.Tensor, num_experts: int, local: torch.Tensor | None = None,
                skips: bool = False) -> ExpertRows:
    """ids [T, K] int64 in [0, E), or -1 for a skipped pick where `skips`. `local` [E] int64:
    each expert's index among the `num_experts` computed here, -1 for one computed elsewhere.
    Pairs whose (local) expert is -1 are left out."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [T K]
    pairs: torch.Tensor | None = None  # the (token, slot) pairs computed here, if not all
    if local is not None:
        flat = local[flat]
    if local is not None or skips:
        pairs = (flat >= 0).nonzero().squeeze(1)  # [R]
        flat = flat[pairs]
    order = torch.argsort(flat, stable=True)
    pair = order if pairs is None else pairs[order]  # [R] into [T K], grouped by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [P]
    return ExpertRows(pair, pair // k, counts)


def expert_loop(xs: torch.Tensor, bounds: list[int], mlp: ExpertMLP, out: torch.Tensor) -> None:
    """out[rows of e] += mlp(e, xs[rows of e]) for each expert e with rows (`ExpertRows.bounds`);
    xs [R, H] and out [R, H_out] in the `ExpertRows` order."""
    for expert in range(len(bounds) - 1):
        rows = slice(bounds[expert], bounds[expert + 1])
        if rows.start != rows.stop:
            out[rows] += mlp(expert, xs[rows])


def combine(y: torch.Tensor, rows: ExpertRows, weights: torch.Tensor, x: torch.Tensor
            ) -> torch.Tensor:
    """y [R, >= H] fp32 expert outputs in `rows` order -> [T, H] in x's dtype: each row times its
    pick's weight (weights [T, K]), added into its token's row."""
    t, h = x.shape
    scaled = y[:, :h] * weights.reshape(-1)[rows.pair, None].float()
    out = torch.zeros(t, h, device=x.device, dtype=torch.float32)
    return out.index_add_(0, rows.token, scaled).to(x.dtype)


def grouped_mm_available(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs here (bf16 grouped GEMM, CUDA sm90+)."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def routed_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               parts: list[tuple[torch.Tensor, torch.Tensor]], grouped: bool,
               local: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], ids [T, K] int64 in [0, E), weights [T, K]; parts: per NUMA group (gate_up
    [P, 2S, Hp] gate rows first, down [P, Hn, S]; Hp, Hn >= H, zero-padded) bf16 -> [T, H] in
    x's dtype. `local` [E] int64: each expert's index in parts, -1 for an expert computed
    elsewhere (its pairs are left out); None: parts hold every expert (P = E)."""
    e, _, hp = parts[0][0].shape
    hn = parts[0][1].shape[1]
    rows = expert_rows(ids, e, local)
    xs = F.pad(x[rows.token].to(torch.bfloat16), (0, hp - x.shape[1]))  # [R, Hp]
    y = torch.zeros(rows.pair.shape[0], hn, device=x.device, dtype=torch.float32)
    # As the CPU kernels: bf16 inputs, fp32 accumulation and SiLU, one rounding of the
    # intermediate to bf16 before the down projection.
    if grouped:
        ends = rows.counts.cumsum(0).to(torch.int32)  # [E]
        for gate_up, down in parts:
            s = down.shape[2]
            # The grouped GEMM accumulates in fp32 and writes bf16 (its only output dtype).
            h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).float()  # [R, 2S]
            a = (F.silu(h[:, :s]) * h[:, s:]).to(torch.bfloat16)
            y += torch._grouped_mm(a, down.transpose(1, 2), offs=ends).float()
    else:
        bounds = rows.bounds()
        for gate_up, down in parts:
            expert_loop(xs, bounds, _bf16_mlp(gate_up, down), y)
    return combine(y, rows, weights, x)


def _bf16_mlp(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertMLP:
    """The CPU kernels' expert MLP on one NUMA group's slice (bf16 in, fp32 out)."""
    s = down.shape[2]

    def mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        h = xs.float() @ gate_up[expert].float().T  # [m, 2S]
        a = (F.silu(h[:, :s]) * h[:, s:]).to(torch.bfloat16)
        return a.float() @ down[expert].float().T  # [m, Hn]

    return mlp
