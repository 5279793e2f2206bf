"""Layer error of int8 quantization choices, in float64: what per-channel int8 would cost.

The AMX int8 kernel spends about a third of its time on per-group work (each group's int32 tiles
stored and fixed up in fp32: docs/benchmarks/cpu_moe.md, round 7). Only one scale per output
channel for the weights and one per token for the activations removes it; this script measures
what that costs in accuracy on a Gaussian expert of a real shape, against the groups the packed
format uses. It simulates the packed quantizers (weights: symmetric absmax int8 per (row,
group); activations: asymmetric u8 per (token, group), then SiLU(gate) * up requantized for the
down projection) and checks the simulation against `CpuMoE` itself for the packed group sizes.
Prints a table and writes JSON.

Usage: python benchmarks/kernels/quant_error.py [--shape qwen3-30b-a3b] [--tokens 256] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from hetmoe.bench.shapes import routed_expert_shape
from hetmoe.experts import CpuMoE


def quant_weight(w: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric absmax int8 per (row, group of columns), dequantized."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((g / scale).round().clamp(-127, 127) * scale).reshape(rows, cols)


def quant_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """Asymmetric u8 per (token, group of columns), dequantized."""
    rows, cols = x.shape
    g = x.reshape(rows, cols // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp_min(1e-30) / 255
    return (((g - lo) / scale).round().clamp(0, 255) * scale + lo).reshape(rows, cols)


def expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           w_groups: tuple[int, int] | None, a_groups: tuple[int, int] | None) -> torch.Tensor:
    """down(SiLU(gate x) * up x) with weights and activations quantized in groups (gate/up input
    dim, down input dim), or exact where None."""
    wq = (lambda w, g: quant_weight(w, g)) if w_groups else (lambda w, g: w)
    aq = (lambda a, g: quant_act(a, g)) if a_groups else (lambda a, g: a)
    wg, wd = w_groups or (0, 0)
    ag, ad = a_groups or (0, 0)
    xq = aq(x, ag)
    h = F.silu(xq @ wq(gate, wg).T) * (xq @ wq(up, wg).T)
    return aq(h, ad) @ wq(down, wd).T


def main(argv: list[str] | None = None) -> dict:
    """Runs the comparison (`argv` as on the command line); returns what it writes as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("quant_error.json"))
    args = parser.parse_args(argv)
    _, H, I, _ = routed_expert_shape(args.shape)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tokens, H, generator=g, dtype=torch.float64)
    gate = torch.randn(I, H, generator=g, dtype=torch.float64) / H**0.5
    up = torch.randn(I, H, generator=g, dtype=torch.float64) / H**0.5
    down = torch.randn(H, I, generator=g, dtype=torch.float64) / I**0.5
    ref = expert(x, gate, up, down, None, None)

    def err(out: torch.Tensor) -> float:
        return float((out.double() - ref).norm() / ref.norm())

    cases = [("groups of 64", (64, 64), (64, 64)), ("groups of 128 (default)", (128, 128),
             (128, 128)), ("groups of 256", (256, 256), (256, 256)),
             ("per-channel weights, activations in groups of 128", (H, I), (128, 128)),
             ("weights in groups of 128, per-token activations", (128, 128), (H, I)),
             ("per-channel weights, per-token activations", (H, I), (H, I))]
    rows = []
    for name, wgs, ags in cases:
        row = {"case": name, "weight_groups": wgs, "act_groups": ags,
               "simulated": err(expert(x, gate, up, down, wgs, ags))}
        if wgs == ags and wgs[0] in (64, 128, 256):  # a packed format: the kernels themselves
            moe = CpuMoE(1, H, I, "int8", group_size=wgs[0])
            moe.load(gate[None].float(), up[None].float(), down[None].float())
            ids = torch.zeros(args.tokens, 1, dtype=torch.int64)
            row["cpu_moe"] = err(moe.forward(x.float(), ids, torch.ones(args.tokens, 1)))
        rows.append(row)
    print(f"{args.shape} expert (H {H}, I {I}), {args.tokens} Gaussian tokens: relative error "
          "against float64")
    print(f"{'int8 quantization':52} {'simulated':>9} {'CpuMoE':>8}")
    for r in rows:
        kernel = f"{r['cpu_moe']:.4f}" if "cpu_moe" in r else "-"
        print(f"{r['case']:52} {r['simulated']:9.4f} {kernel:>8}")
    report = {"shape": args.shape, "tokens": args.tokens, "rows": rows}
    args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
