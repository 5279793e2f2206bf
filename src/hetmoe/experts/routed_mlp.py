"""Routed experts of one layer in torch, on unpacked weights: the GPU prefill's compute.

out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], summed over the
NUMA groups' slices of the intermediate dimension (each a `packed_layout.unpack_group` result).
The (token, slot) rows are sorted by expert once; each expert's rows are one matrix product per
projection: `torch._grouped_mm` on GPUs that have it (sm90+, one launch for all experts),
else a loop over the experts that got rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    t, k = ids.shape
    e, _, hp = parts[0][0].shape
    hn = parts[0][1].shape[1]
    flat = ids.reshape(-1)  # [T K]
    pairs: torch.Tensor | None = None  # the (token, slot) pairs computed here, if not all
    if local is not None:
        flat = local[flat]
        pairs = (flat >= 0).nonzero().squeeze(1)  # [R]
        flat = flat[pairs]
    order = torch.argsort(flat, stable=True)
    pair = order if pairs is None else pairs[order]  # [R] into [T K], grouped by expert
    token = pair // k
    counts = torch.bincount(flat, minlength=e)  # [P]
    xs = F.pad(x[token].to(torch.bfloat16), (0, hp - x.shape[1]))  # [R, Hp]
    y = torch.zeros(flat.shape[0], hn, device=x.device, dtype=torch.float32)
    # As the CPU kernels: bf16 inputs, fp32 accumulation and SiLU, one rounding of the
    # intermediate to bf16 before the down projection.
    if grouped:
        ends = counts.cumsum(0).to(torch.int32)  # [E]
        for gate_up, down in parts:
            s = down.shape[2]
            # The grouped GEMM accumulates in fp32 and writes bf16 (its only output dtype).
            h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends).float()  # [R, 2S]
            a = (F.silu(h[:, :s]) * h[:, s:]).to(torch.bfloat16)
            y += torch._grouped_mm(a, down.transpose(1, 2), offs=ends).float()
    else:
        bounds = [0, *counts.cumsum(0).tolist()]
        for gate_up, down in parts:
            s = down.shape[2]
            for expert in range(e):
                rows = slice(bounds[expert], bounds[expert + 1])
                if rows.start == rows.stop:
                    continue
                h = xs[rows].float() @ gate_up[expert].float().T  # [m, 2S]
                a = (F.silu(h[:, :s]) * h[:, s:]).to(torch.bfloat16)
                y[rows] += a.float() @ down[expert].float().T
    scaled = y[:, :x.shape[1]] * weights.reshape(-1)[pair, None].float()
    out = torch.zeros(t, x.shape[1], device=x.device, dtype=torch.float32)
    return out.index_add_(0, token, scaled).to(x.dtype)
