"""The CPU expert backend's oracle: float64 reference layers, random weights, ISAs to test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hetmoe import _cpu
from hetmoe.experts import CpuMoE
from hetmoe.experts.packed_layout import host_tensor

ISA_ORDER = ("scalar", "avx2", "avx512", "amx")


def available_isas() -> list[str]:
    """Every kernel family this machine runs (the tests cover each one)."""
    return list(ISA_ORDER[: ISA_ORDER.index(_cpu.best_isa()) + 1])


def check_int_isas(weight_format: str, outs: dict[str, torch.Tensor], ref: torch.Tensor,
                   bound: float) -> None:
    """Int outputs of several ISAs (keyed by ISA; "amx" only if it ran experts on tiles): within
    `bound` of float64, and the same floats on every ISA, except int4 on AMX tiles, which
    multiplies both operands dequantized to bf16 (kernels/amx.cpp) instead of in integers: its
    floats differ by that rounding and the hidden activations it requantizes, so it must be at
    least as close to float64 as the integer kernels (5 % slack)."""
    on_bf16 = weight_format == "int4" and "amx" in outs
    exact = {isa: out for isa, out in outs.items() if not (on_bf16 and isa == "amx")}
    first_isa, first = next(iter(exact.items()))
    int_error = rel_error(first, ref)
    assert int_error <= bound, (first_isa, int_error)
    for isa, out in exact.items():
        assert torch.equal(out, first), f"{isa} differs from {first_isa}"
    if on_bf16:
        amx_error = rel_error(outs["amx"], ref)
        assert amx_error <= min(bound, 1.05 * int_error), (amx_error, int_error)


@dataclass
class Experts:
    """Unquantized random expert weights of one layer (Gaussian, unit-variance outputs)."""

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gpu_mask: torch.Tensor | None = None) -> torch.Tensor:
        """float64 sum_j w_j * down_e(silu(gate_e x) * up_e x), skipping -1 and GPU experts."""
        x64 = x.double()  # [q, H]
        out = torch.zeros_like(x64)
        for e in range(self.gate.shape[0]):
            if gpu_mask is not None and bool(gpu_mask[e]):
                continue
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x64[tok]  # [n, H]
            h = torch.nn.functional.silu(xe @ self.gate[e].double().T) * (
                xe @ self.up[e].double().T
            )
            y = h @ self.down[e].double().T  # [n, H]
            out.index_add_(0, tok, y * weights[tok, slot].double()[:, None])
        return out


def make_experts(num_experts: int, hidden: int, intermediate: int, seed: int) -> Experts:
    """Fresh Gaussian weights for (E, H, I), scaled so every projection keeps unit variance."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(num_experts, intermediate, hidden, generator=g) / hidden**0.5
    up = torch.randn(num_experts, intermediate, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5
    return Experts(gate, up, down)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||."""
    return float((out.double() - ref).norm() / ref.norm())


def write_packed_groups(moe: CpuMoE, path: Path | str) -> list[int]:
    """`moe`'s packed groups written to one file as `hetmoe convert` lays a layer out (each
    group at a 2 MiB-aligned offset); the offsets, for `CpuMoE.map_file`."""
    offsets, at = [], 0
    with open(path, "wb") as f:
        for part in moe.packed_groups():
            offsets.append(at)
            f.seek(at)
            f.write(host_tensor(part).numpy().data)
            at += -(-part.bytes // (2 << 20)) * (2 << 20)
    return offsets
