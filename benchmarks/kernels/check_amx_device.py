"""AMX correctness on a machine that has it: CpuMoE with AMX for every expert call against a
float64 reference on the unquantized weights, at Qwen3-30B-A3B's expert shape (~150 rows per
expert, as in prefill), per format (int8 with the default groups of 128 and with 64); and the
same inputs through AVX-512 and AVX2 (bf16 must agree far below its bound; the int formats give
the same floats on every ISA). Prefill keeps the rows of AMX experts in tile order; a "mixed" call
(AMX only from the median rows per expert up, so experts in tile order and row-major experts on
AVX-512 meet in one call) must agree the same way.

Exits 1 if AMX is missing or any bound is exceeded. Usage:
python benchmarks/kernels/check_amx_device.py [--json check_amx.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hetmoe import _cpu
from hetmoe.experts import CpuMoE

BOUND = {"bf16": 1e-2, "int8": 2e-2, "int8:64": 2e-2, "int4": 0.15}
"""Per format (FORMAT or FORMAT:GROUP_SIZE), the layer error bound of issue 3."""


def reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
              w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float64 sum_j w_j * down_e(silu(gate_e x) * up_e x)."""
    gate, up, down = w
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].double()  # [n, H]
        h = torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out.index_add_(0, tok, (h @ down[e].double().T) * wts[tok, slot, None].double())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("check_amx.json"))
    args = parser.parse_args()
    if _cpu.best_isa() != "amx":
        print(f"AMX is not available here (best ISA: {_cpu.best_isa()})")
        return 1
    E, H, I, q, k = 16, 2048, 768, 300, 8
    g = torch.Generator().manual_seed(0)
    w = tuple(torch.randn(E, *s, generator=g) / s[1] ** 0.5 for s in ((I, H), (I, H), (H, I)))
    x = torch.randn(q, H, generator=g)
    ids = torch.randn(q, E, generator=g).topk(k, dim=1).indices
    ids[:5, 3] = -1
    wts = torch.rand(q, k, generator=g)
    ref = reference(x, ids, wts, w)
    median_rows = int(ids[ids >= 0].bincount(minlength=E).median())
    results, ok = [], True
    for spec in BOUND:
        fmt, _, group = spec.partition(":")
        outs = {}
        for isa in ("amx", "avx512", "avx2"):
            moe = CpuMoE(E, H, I, fmt, group_size=int(group) if group else None, isa=isa,
                         amx_min_tokens=1)
            moe.load(*w)
            outs[isa] = moe.forward(x, ids, wts, out=torch.full_like(x, float("nan")))
            if isa == "amx":
                moe.amx_min_tokens = median_rows
                mixed = moe.forward(x, ids, wts, out=torch.full_like(x, float("nan")))
        err = float((outs["amx"].double() - ref).norm() / ref.norm())
        agree = float((outs["amx"] - outs["avx512"]).norm() / outs["avx512"].norm())
        mixed_agree = float((mixed - outs["avx512"]).norm() / outs["avx512"].norm())
        same_bits = all(torch.equal(outs["amx"], out) for out in [*outs.values(), mixed])
        passed = (err <= BOUND[spec] and max(agree, mixed_agree) < 1e-4
                  and not outs["amx"].isnan().any() and not mixed.isnan().any()
                  and (fmt == "bf16" or same_bits))
        ok &= passed
        results.append({"format": spec, "rel_error_vs_float64": err, "bound": BOUND[spec],
                        "amx_vs_avx512": agree, "mixed_vs_avx512": mixed_agree,
                        "same_floats_amx_mixed_avx512_avx2": same_bits,
                        "passed": passed})
        print(f"{spec:7} AMX rel. error {err:.4f} (bound {BOUND[spec]}), "
              f"AMX vs AVX-512 {agree:.2e} (mixed {mixed_agree:.2e}), same floats on "
              f"AMX/mixed/AVX-512/AVX2: {same_bits}: "
              f"{'ok' if passed else 'FAILED'}")
    args.json.write_text(json.dumps({"shape": [E, H, I, q, k], "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
