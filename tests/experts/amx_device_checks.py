"""AMX correctness on a machine that has it (what CI cannot run; run by
`pytest -m device tests/experts/test_amx_device.py`): CpuMoE with AMX for every expert call
against a float64 reference on the unquantized weights, at Qwen3-30B-A3B's expert shape (~150 rows
per expert, as in prefill), per format (int8 with the default groups of 128 and with 64); and the
same inputs through AVX-512 and AVX2 (bf16 must agree far below its bound; int8 gives the same
floats on every ISA; int4, which AMX multiplies as bf16 tiles, is at least as close to float64 as
the integer kernels). Prefill keeps the rows of AMX experts in tile order; a "mixed" call
(AMX only from the median rows per expert up, so experts in tile order and row-major experts on
AVX-512 meet in one call) must agree the same way.
"""

from __future__ import annotations

import functools

import torch

from hetmoe.experts import CpuMoE

BOUND = {"bf16": 1e-2, "int8": 2e-2, "int8:64": 2e-2, "int4": 0.15}
"""Per format (FORMAT or FORMAT:GROUP_SIZE), the layer error bound of issue 3."""
SHAPE = (16, 2048, 768, 300, 8)
"""(experts, hidden, intermediate, tokens, top-k): Qwen3-30B-A3B's experts, a prefill call."""

Weights = tuple[torch.Tensor, ...]
"""(gate [E, I, H], up [E, I, H], down [E, H, I]), unquantized."""


def reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
              w: Weights) -> torch.Tensor:
    """float64 sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    gate, up, down = w
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].double()  # [n, H]
        h = torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out.index_add_(0, tok, (h @ down[e].double().T) * wts[tok, slot, None].double())
    return out


@functools.cache
def layer() -> tuple[Weights, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The random layer and call (seed 0), shared by every format: weights, x [q, H], ids and
    wts [q, k] (5 slots -1), the float64 output and the median rows per expert."""
    E, H, I, q, k = SHAPE
    g = torch.Generator().manual_seed(0)
    w = tuple(torch.randn(E, *s, generator=g) / s[1] ** 0.5 for s in ((I, H), (I, H), (H, I)))
    x = torch.randn(q, H, generator=g)
    ids = torch.randn(q, E, generator=g).topk(k, dim=1).indices
    ids[:5, 3] = -1
    wts = torch.rand(q, k, generator=g)
    median_rows = int(ids[ids >= 0].bincount(minlength=E).median())
    return w, x, ids, wts, reference(x, ids, wts, w), median_rows


def check_format(spec: str, isa: str = "amx") -> dict[str, object]:
    """One format's row: `isa`'s error against float64 and its agreement with AVX-512 and AVX2,
    alone and mixed; "passed" if every bound holds. Another `isa` than AMX (e.g. "avx512")
    exercises this harness on a host without AMX; the device test runs AMX."""
    E, H, I, _, _ = SHAPE
    w, x, ids, wts, ref, median_rows = layer()
    fmt, _, group = spec.partition(":")
    outs = {}
    for name in dict.fromkeys((isa, "avx512", "avx2")):
        moe = CpuMoE(E, H, I, fmt, group_size=int(group) if group else None, isa=name,
                     amx_min_tokens=1)
        moe.load(*w)
        outs[name] = moe.forward(x, ids, wts, out=torch.full_like(x, float("nan")))
        if name == isa:
            moe.amx_min_tokens = median_rows
            mixed = moe.forward(x, ids, wts, out=torch.full_like(x, float("nan")))
    err = float((outs[isa].double() - ref).norm() / ref.norm())
    agree = float((outs[isa] - outs["avx512"]).norm() / outs["avx512"].norm())
    mixed_agree = float((mixed - outs["avx512"]).norm() / outs["avx512"].norm())
    same_bits = all(torch.equal(outs[isa], out) for out in [*outs.values(), mixed])
    if fmt == "int4" and isa == "amx":
        # int4 on AMX multiplies bf16 tiles (kernels/amx.cpp), not integers: not the same floats
        # as AVX-512 / AVX2, so as tests/experts/moe_oracle.check_int_isas: at least as close to
        # float64 as the integer kernels (5 % slack), alone and mixed
        int_err = float((outs["avx512"].double() - ref).norm() / ref.norm())
        mixed_err = float((mixed.double() - ref).norm() / ref.norm())
        agrees = max(err, mixed_err) <= min(BOUND[spec], 1.05 * int_err) and torch.equal(
            outs["avx512"], outs["avx2"])
    else:
        agrees = max(agree, mixed_agree) < 1e-4 and (fmt == "bf16" or same_bits)
    passed = (err <= BOUND[spec] and agrees
              and not outs[isa].isnan().any() and not mixed.isnan().any())
    return {"format": spec, "isa": isa, "rel_error_vs_float64": err, "bound": BOUND[spec],
            "vs_avx512": agree, "mixed_vs_avx512": mixed_agree,
            "same_floats_mixed_avx512_avx2": same_bits, "passed": passed}
