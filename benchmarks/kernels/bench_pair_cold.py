"""The pair kernels (decode's `packed_moe` path) timed as the decode step runs them, beside the
condition `bench_packed_moe.py --pair-sweep` timed them in.

The sweep replays one call in a CUDA graph: the same 8 experts every replay (26 MB of INT4 at
G 32, 40 MB of INT8 at G 128, against an H100's 50 MB L2) and x in bf16. The decode step calls
`packed_moe` once per MoE layer (48 on Qwen3-30B-A3B), each on its own layer's bytes, so a
layer's experts were last read 47 calls earlier (HBM, not L2), and x is the fp32 view of the
step's staged inputs (ops/fused.py `unpack_moe_inputs`; the kernels round it to bf16). Per
format, launch shape and T this times one graph of `--layers` calls three ways, ms a call:

- hot bf16: every call on one copy of the layer, x bf16 (the sweep's condition);
- hot fp32: the same, x fp32;
- cold fp32: each call on its own copy of the layer (the decode step's condition).

The three give the same output (asserted to 1e-5, the atomics' order aside: x is drawn in bf16,
so its fp32 view rounds back to it). Each format's `PAIR_CONFIGS` shape comes first, then
`--shapes` (FMT=fields as `parse_pair_config` reads them).

    python benchmarks/kernels/bench_pair_cold.py --formats int8,int4 --tokens 1,8 \\
        --shapes int4=32,1,64,1,4,2,4,1,1 int4=16,2,64,3,4,4,4,1 --json F
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from bench_packed_moe import build_layer, copy_bandwidth, graph_ms, inputs

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor
from hetmoe.kernels.packed_moe import packed_moe
from hetmoe.kernels.pair_config import (
    ONE_TOKEN_PAIR_CONFIGS,
    PAIR_CONFIGS,
    PairConfig,
    parse_pair_config,
)
from hetmoe.machine import machine_report

CONDITIONS = (("hot_bf16", torch.bfloat16, False), ("hot_fp32", torch.float32, False),
              ("cold_fp32", torch.float32, True))
"""(name, x's dtype, each call on its own copy) of the three timings."""


def parse_shapes(texts: list[str], formats: list[str]) -> dict[str, list[PairConfig]]:
    """Per format: the shipped shapes (`PAIR_CONFIGS`', then `ONE_TOKEN_PAIR_CONFIGS`' where the
    format has one), then the `FMT=fields` shapes given for it."""
    shapes = {fmt: [PAIR_CONFIGS[fmt], *([ONE_TOKEN_PAIR_CONFIGS[fmt]]
                                        if fmt in ONE_TOKEN_PAIR_CONFIGS else [])]
              for fmt in formats}
    for text in texts:
        fmt, sep, fields = text.partition("=")
        if not sep or fmt not in shapes:
            raise ValueError(f"--shapes {text!r}: FMT=fields with FMT one of "
                             f"{', '.join(formats)} (the --formats)")
        cfg = parse_pair_config(fields)
        if cfg not in shapes[fmt]:
            shapes[fmt].append(cfg)
    return shapes


def layer_copies(raw: torch.Tensor, layers: int) -> list[torch.Tensor]:
    """`raw` and `layers` - 1 copies of it in their own memory: the step's other layers."""
    if layers < 2:
        raise ValueError(f"--layers must be at least 2 (a cold call needs other layers' "
                         f"bytes between two reads of its own), got {layers}")
    return [raw] + [raw.clone() for _ in range(layers - 1)]


def time_conditions(moe: CpuMoE, raws: list[torch.Tensor], cfg: PairConfig, t: int, k: int,
                    repeats: int, timer: Callable[[Callable[[], Any], int], float] = graph_ms
                    ) -> dict[str, float]:
    """ms a call of each of `CONDITIONS` (one graph of len(raws) calls), at t tokens."""
    (part,) = moe.packed_groups()
    fmt, h = moe.weight_format, moe.hidden
    x, ids, w = inputs(t, h, moe.num_experts, k, raws[0].device)
    times, outputs = {}, []
    for name, dtype, cold in CONDITIONS:
        xs = x.to(dtype)
        data = raws if cold else [raws[0]] * len(raws)
        results: list[torch.Tensor] = []

        def calls(xs: torch.Tensor = xs, data: list[torch.Tensor] = data,
                  results: list[torch.Tensor] = results) -> None:
            results[:] = [packed_moe(xs, ids, w, r, part, fmt, h, moe.group_size, "pairs", cfg)
                          for r in data]

        times[name] = timer(calls, repeats) / len(raws)
        outputs += results
    # the same sums but for the order of the down kernel's fp32 atomics (~1e-7)
    diff = max(float((out - outputs[0]).norm() / outputs[0].norm()) for out in outputs)
    if diff > 1e-5:
        raise AssertionError(f"{fmt} {cfg} T={t}: the conditions' outputs differ by {diff:.2e} "
                             f"(relative): x's fp32 view or a layer copy changed a value")
    return times


def format_rows(moe: CpuMoE, raws: list[torch.Tensor], shapes: list[PairConfig],
                tokens: list[int], k: int, bandwidth: float, repeats: int) -> list[dict[str, Any]]:
    """One row per (shape, T): the three ms a call, cold over hot, cold's % of the bytes
    floor (the distinct experts routed to, packed, at the measured copy rate)."""
    (part,) = moe.packed_groups()
    rows = []
    for cfg in shapes:
        for t in tokens:
            ids = inputs(t, moe.hidden, moe.num_experts, k, raws[0].device)[1]
            floor = ids.unique().numel() * part.expert_bytes / bandwidth * 1e3
            ms = time_conditions(moe, raws, cfg, t, k, repeats)
            rows.append({"format": moe.weight_format, "group": moe.group_size,
                         "config": dataclasses.astuple(cfg), "tokens": t,
                         **{name: round(v, 4) for name, v in ms.items()},
                         "cold_over_hot": round(ms["cold_fp32"] / ms["hot_bf16"], 3),
                         "floor_ms": round(floor, 4),
                         "cold_of_floor": round(floor / ms["cold_fp32"], 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| format | shape | T | hot bf16 ms (the sweep's) | hot fp32 ms | cold fp32 ms "
          "(the step's) | cold / hot | cold % of bytes floor |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} G {r['group']} | {tuple(r['config'])} | {r['tokens']} | "
              f"{r['hot_bf16']} | {r['hot_fp32']} | {r['cold_fp32']} | "
              f"{r['cold_over_hot']:.2f}x | {100 * r['cold_of_floor']:.0f} % |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="int8,int4")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--layers", type=int, default=8,
                   help="calls a graph (cold: each on its own copy of the layer)")
    p.add_argument("--shapes", nargs="*", default=[],
                   help="FMT=PairConfig fields (comma-separated, flags 0/1) beside PAIR_CONFIGS")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    shapes = parse_shapes(args.shapes, formats)  # before minutes of packing
    if args.layers < 2:
        p.error(f"--layers must be at least 2 (a cold call needs other layers' bytes between two "
                f"reads of its own), got {args.layers}")
    tokens = [int(n) for n in args.tokens.split(",") if n.strip().isdigit() and int(n) > 0]
    if len(tokens) != len(args.tokens.split(",")):
        p.error(f"--tokens takes positive integers, comma-separated, got {args.tokens!r}")
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for fmt in formats:
        moe = build_layer(fmt, args.experts, args.hidden, args.intermediate)
        (part,) = moe.packed_groups()
        raws = layer_copies(host_tensor(part).to("cuda"), args.layers)
        rows += format_rows(moe, raws, shapes[fmt], tokens, args.top_k, bandwidth,
                            args.repeats)
        del raws
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"layers": args.layers, "rows": rows, "machine": machine_report(),
                           "device": torch.cuda.get_device_name(),
                           "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3)}, f, indent=1)
    print_table(rows)


if __name__ == "__main__":
    main()
