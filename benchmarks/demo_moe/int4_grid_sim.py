"""Would finer activation scales save the AMX int4 kernel on int8 tiles? A float64 model of its
math on `demo-moe`'s recorded MoE inputs, per size of activation-scale chunk.

Both AMX int4 kernels receive each activation row as u8 (asymmetric, one scale and zero point
per group of 32 k). The int8-tile kernel (HETMOE_AMX_INT4=i8) requantizes those rows to
symmetric int8 with one scale per row; here the scale is per (row, chunk of Q k-steps of 64),
Q from --chunks ("row": one over all of K, today's kernel), with the weights on a per-channel
int8 grid (largest |w| / 127). The bf16-tile reference is modelled as the u8 rows and the
weights rounded to bf16. Two splits say which grid costs what: the weight grid alone (exact
activations) and the activation rows alone at Q = 1 (exact weights, no u8 step); a third gives
the u8 rows alone. Every row's error is relative, against float64 on the unquantized weights,
per MoE layer (its calls over the held-out windows, recorded with torch fp32 experts by
int4_kernels.reference: no AMX needed). It exists to decide whether per-chunk activation scales
are worth building into the kernel (docs/benchmarks/demo_moe.md, "Int4 on AMX").

Usage: python benchmarks/demo_moe/int4_grid_sim.py [--windows 6] [--window 256]
           [--chunks 1,2,4,8,row] [--json docs/benchmarks/demo_moe_int4_grid_sim.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from demo_moe_eval import stamp
from int4_kernels import Call, Weights, reference, rel_error
from quality import load

from hetmoe.ops.moe import moe_layers

STEP = 64
"""k per AMX int8 tile step: a chunk of Q steps is Q * 64 k."""
U8_GROUP = 32
"""k per u8 activation group (its own scale and zero point)."""
Act = Callable[[torch.Tensor], torch.Tensor]
"""float64 [n, K] rows -> the same rows as a kernel sees them, dequantized."""


def int8_rows(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x [n, K] on symmetric int8, one scale per (row, `chunk` k), dequantized; zero padding
    up to a whole chunk changes no scale."""
    n, k = x.shape
    chunk = min(chunk, k)
    chunks = -(-k // chunk)
    g = F.pad(x, (0, chunks * chunk - k)).view(n, chunks, chunk)  # [n, C, chunk]
    scale = g.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, 1.0)
    return (torch.round(g / safe) * scale).view(n, -1)[:, :k]


def u8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] as the u8 rows both kernels receive (asymmetric per group of 32), dequantized."""
    n, k = x.shape
    if k % U8_GROUP:
        raise ValueError(f"u8 rows need K divisible by {U8_GROUP}; got K = {k}")
    g = x.view(n, k // U8_GROUP, U8_GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / 255
    u = torch.clamp(torch.floor((g - lo) / torch.where(scale > 0, scale, 1.0) + 0.5), 0, 255)
    return (lo + u * scale).view(n, k)


def int8_channels(w: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] on one symmetric int8 grid per output channel (largest |w| / 127)."""
    scale = w.abs().amax(-1, keepdim=True) / 127
    return torch.round(w / torch.where(scale > 0, scale, 1.0)) * scale


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def simulated(call: Call, weights: Weights, act: Act) -> torch.Tensor:
    """float64 [T, H]: the call's experts with `act` on both matmuls' activation rows (rows are
    quantized alone, so x is quantized once for all experts)."""
    x, ids, picks = call
    gate, up, down = weights
    xq, out = act(x.double()), torch.zeros(x.shape, dtype=torch.float64)
    for e in range(gate.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            h = F.silu(xq[tok] @ gate[e].T) * (xq[tok] @ up[e].T)  # [n, I]
            out.index_add_(0, tok, (act(h) @ down[e].T) * picks[tok, slot].double()[:, None])
    return out


def chunk_name(q: int | None) -> str:
    return "per row (today's kernel)" if q is None else f"per {q * STEP} k (Q = {q})"


def on_grid(w: Weights) -> Weights:
    """Each weight on its per-channel int8 grid."""
    return int8_channels(w[0]), int8_channels(w[1]), int8_channels(w[2])


def in_bf16(w: Weights) -> Weights:
    return bf16(w[0]), bf16(w[1]), bf16(w[2])


def unquantized(w: Weights) -> Weights:
    return w


def kernel_rows(chunk: int) -> Act:
    """The int8-tile kernel's rows: the u8 rows requantized per (row, `chunk` k)."""
    return lambda t: int8_rows(u8_rows(t), chunk)


def variants(chunks: list[int | None]) -> dict[str, tuple[Callable[[Weights], Weights], Act]]:
    """Table row -> (weights as the kernel holds them, activation rows as it sees them)."""
    rows: dict[str, tuple[Callable[[Weights], Weights], Act]] = {}
    for q in chunks:
        rows[chunk_name(q)] = (on_grid, kernel_rows(1 << 30 if q is None else q * STEP))
    rows["bf16 tiles (u8 rows, bf16 weights)"] = (in_bf16, lambda t: bf16(u8_rows(t)))
    rows["weight grid alone (exact rows)"] = (on_grid, lambda t: t)
    rows["rows at Q = 1 alone (exact weights, no u8 step)"] = (
        unquantized, lambda t: int8_rows(t, STEP))
    rows["u8 rows alone (exact weights)"] = (unquantized, u8_rows)
    return rows


@torch.inference_mode()
def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, list[float]]:
    """Per table row, the relative error of each MoE layer."""
    ref = reference(argparse.Namespace(window=args.window, windows=args.windows,
                                       max_new_tokens=0), log)
    llm, _ = load("demo-moe", args.window)
    rows = variants(args.chunks)
    errors: dict[str, list[float]] = {name: [] for name in rows}
    for i, (m, calls) in enumerate(zip(moe_layers(llm.model), ref.calls, strict=True)):
        experts: Any = m.experts  # a module attribute: typed Tensor | Module
        w: Weights = (experts.gate.double(), experts.up.double(), experts.down.double())
        for name, (held, act) in rows.items():
            wq = held(w)
            got = torch.cat([simulated(c, wq, act) for c in calls])
            errors[name].append(rel_error(got, ref.exact[i]))
        log(f"layer {i}: " + ", ".join(f"{v[-1]:.4f}" for v in errors.values()))
    return errors


def table(errors: dict[str, list[float]]) -> str:
    """Mean / max over layers, the worst layer of today's kernel, the ratio to bf16 tiles."""
    worst_of = errors.get(chunk_name(None), next(iter(errors.values())))
    worst = max(range(len(worst_of)), key=worst_of.__getitem__)
    base = sum(errors["bf16 tiles (u8 rows, bf16 weights)"]) / len(worst_of)
    lines = [f"| activation scale | kernel error (mean / max) | layer {worst} | "
             f"vs bf16 tiles ({base:.4f}) |", "|---|---:|---:|---:|"]
    for name, v in errors.items():
        mean = sum(v) / len(v)
        lines.append(f"| {name} | {mean:.4f} / {max(v):.4f} | {v[worst]:.4f} | "
                     f"{mean / base:.2f}x |")
    return "\n".join(lines)


def chunk_list(value: str) -> list[int | None]:
    """--chunks: Q values (k-steps of 64 per scale) and "row" (one scale over all of K)."""
    out: list[int | None] = []
    for part in (p.strip() for p in value.split(",") if p.strip()):
        if part == "row":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(
                f"--chunks takes positive integers and 'row'; got {part!r} in {value!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"--chunks names no chunk size: {value!r}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=256, help="tokens per window (prefill)")
    parser.add_argument("--chunks", type=chunk_list, default=chunk_list("1,2,4,8,row"),
                        help="Q per activation scale (k-steps of 64), or 'row'")
    parser.add_argument("--json", type=Path,
                        default=Path("docs/benchmarks/demo_moe_int4_grid_sim.json"))
    args = parser.parse_args(argv)
    if args.windows < 1 or args.window < 2:
        parser.error(f"need >= 1 window of >= 2 tokens, got {args.windows} x {args.window}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    start = time.perf_counter()
    errors = measure(args, lambda line: print(line, flush=True))
    body = table(errors)
    print(body)
    seconds = time.perf_counter() - start
    result = {**stamp(__file__, argv), "windows": args.windows, "window": args.window,
              "chunks": [q or "row" for q in args.chunks], "seconds": round(seconds, 1),
              "layers": errors, "table": body}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{seconds:.0f} s; wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
