"""One MoE layer's routed experts on the GPU from their packed bytes: the Triton kernels
(kernels/packed_moe.py) against the torch unpack + grouped GEMM they replace, per format and
token count, beside the floors measured in the same run: the bytes the layer must read (the
distinct experts routed to, packed) over this GPU's measured copy bandwidth, and the FLOPs
(6 H I per (token, expert) pair) over the bf16 peak. Small T (<= 64) also timed as a CUDA
graph replay (decode's use), and both paths of the kernels at those T: pairs grouped by expert
(`sorted`) and one pair per program (`pairs`, no routing sort). Prints tables and writes JSON.

    python benchmarks/kernels/bench_packed_moe.py --out DIR [--formats bf16,int8,int4,fp8]
        [--tokens 1,8,64,512,4096] [--experts 128 --hidden 2048 --intermediate 768 --top-k 8]

`--pair-sweep FORMATS` instead times the pair kernels' launch shapes (`PairConfig`) at
`--pair-tokens` (1,8,16) as CUDA graph replays, gate/up shapes first then down shapes with the
best gate/up one, then (int8, int4, fp8) the current, best gate/up and best shapes factored
(`PairConfig.factored`; int4 then those and `PAIR_SWEEP_WORDS` read by words, `int4_words`),
and prints each format's best against its bytes floor and the line for `PAIR_CONFIGS` (JSON:
packed_moe_pair_sweep.json).

`--act-quant FORMATS` (int8,fp8) instead times the sorted path with its current bf16 math
beside `act_quant=True` (activations quantized per (row, group), codes on int8 / fp8 tensor
cores; kernels/act_quant.py) at `--act-quant-tokens` (512,4096,16384) on the same layer and
inputs, with the torch quantization step alone and the two outputs' relative difference (JSON:
packed_moe_act_quant.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.cuda_graphs import capture, event_ms
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor, padded_hidden, unpack_group
from hetmoe.experts.routed_mlp import routed_mlp
from hetmoe.kernels import dequant
from hetmoe.kernels import packed_moe as kernel
from hetmoe.kernels.act_quant import quantize_rows
from hetmoe.kernels.packed_moe import TileConfig, packed_moe, tile_config
from hetmoe.kernels.pair_config import PAIR_CONFIGS, PairConfig
from hetmoe.machine import machine_report

BF16_PEAK = 790e12
"""Dense bf16 tensor-core FLOP/s taken as this GPU's peak (H100/H200 SXM, as the issue)."""


def random_weights(experts: int, hidden: int, inter: int) -> list[torch.Tensor]:
    """Gate, up and down of `experts` random experts, N(0, 0.02) as trained weights, bf16."""
    g = torch.Generator().manual_seed(0)
    shapes = ((experts, inter, hidden),) * 2 + ((experts, hidden, inter),)
    return [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in shapes]


def build_layer(fmt: str, experts: int, hidden: int, inter: int) -> CpuMoE:
    """A layer of `random_weights` (fp8: their codes with unit scales)."""
    ws = random_weights(experts, hidden, inter)
    moe = CpuMoE(experts, hidden, inter, fmt)
    if fmt != "fp8":
        moe.load(*ws)
        return moe
    codes = [w.float().mul(64).to(torch.float8_e4m3fn) for w in ws]
    scales = [torch.full((experts, -(-w.shape[1] // 128), -(-w.shape[2] // 128)), 1 / 64)
              for w in ws]
    moe.load(*codes, *scales)
    return moe


def gpu_ms(fn: Any, repeats: int) -> float:
    """Median GPU milliseconds of fn() over `repeats` (after two warm-ups), CUDA events."""
    return statistics.median_high(event_ms(fn, repeats, warmup=2))


def graph_ms(fn: Any, repeats: int) -> float:
    """Median milliseconds of one replay of fn captured in a CUDA graph."""
    graph, _ = capture(fn)
    return gpu_ms(graph.replay, repeats)


def copy_bandwidth(size: int = 1 << 30) -> float:
    """Bytes/s this GPU moves in a device-to-device copy (read + write counted)."""
    a = torch.empty(size, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = gpu_ms(lambda: b.copy_(a), 10)
    return 2 * size / (ms / 1e3)


def inputs(t: int, hidden: int, experts: int, k: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The t tokens every table of this script times: x [t, H] bf16 from N(0, 1), ids [t, k]
    k distinct experts per token drawn uniformly, weights [t, k] from U(0, 1); seeded by t, so
    the main table and both sweeps time the same inputs at the same t."""
    g = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16, generator=g)
    ids = torch.rand(t, experts, device=device, generator=g).topk(k, dim=1).indices
    return x, ids, torch.rand(t, k, device=device, generator=g)


def time_tokens(moe: CpuMoE, raw: torch.Tensor, t: int, k: int, bandwidth: float,
                repeats: int) -> dict[str, Any]:
    """One row: the kernels and the unpack path on t random tokens routed to k experts each."""
    (part,) = moe.packed_groups()
    fmt, e, h, i = moe.weight_format, moe.num_experts, moe.hidden, moe.intermediate
    x, ids, weights = inputs(t, h, e, k, raw.device)
    touched = int(ids.unique().numel())

    def new() -> torch.Tensor:
        return packed_moe(x, ids, weights, raw, part, fmt, h, moe.group_size)

    def old() -> torch.Tensor:
        parts = [unpack_group(raw.view(e, -1), part, fmt, h, moe.group_size)]
        return routed_mlp(x, ids, weights, parts, grouped=True)

    ref = old().float()
    err = float((new() - ref).norm() / ref.norm())
    row: dict[str, Any] = {
        "format": fmt, "tokens": t, "experts_touched": touched,
        "block_m": tile_config(t * k, e).block_m,
        "bytes_floor_ms": round(touched * part.expert_bytes / bandwidth * 1e3, 4),
        "flop_floor_ms": round(6 * h * i * t * k / BF16_PEAK * 1e3, 4),
        "packed_ms": round(gpu_ms(new, repeats), 4),
        "unpack_gemm_ms": round(gpu_ms(old, repeats), 4),
        "rel_diff_vs_unpack": round(err, 5),
    }
    mem = dequant.MEMORY_ORDER[fmt]  # the other way of reading the weights, to check the choice
    dequant.MEMORY_ORDER[fmt] = not mem
    try:
        row[("memory_order" if not mem else "gathered_loads") + "_ms"] = round(
            gpu_ms(new, repeats), 4)
    finally:
        dequant.MEMORY_ORDER[fmt] = mem
    if t <= 64:
        row["packed_graph_ms"] = round(graph_ms(new, repeats), 4)
        for path in ("sorted", "pairs"):  # the two paths `auto` picks from, both timed
            def run(path: str = path) -> torch.Tensor:
                return packed_moe(x, ids, weights, raw, part, fmt, h, moe.group_size, path)

            row[f"{path}_ms"] = round(gpu_ms(run, repeats), 4)
            row[f"{path}_graph_ms"] = round(graph_ms(run, repeats), 4)
    floor = max(row["bytes_floor_ms"], row["flop_floor_ms"])
    best = min(row["packed_ms"], row.get("packed_graph_ms", float("inf")))
    row["of_floor"] = round(floor / best, 3)
    row["speedup"] = round(row["unpack_gemm_ms"] / row["packed_ms"], 2)
    return row


SWEEP = {
    "small": [(16, 32, 64, 4, 3), (16, 16, 32, 2, 3), (16, 64, 64, 4, 2), (16, 32, 128, 4, 4)],
    "large": [(64, 64, 128, 8, 3), (64, 64, 64, 4, 3), (128, 64, 128, 8, 3), (128, 32, 64, 4, 3),
              (32, 64, 128, 4, 3), (64, 32, 64, 4, 4), (128, 64, 64, 8, 4)],
}
"""Tile configs (block_m, block_n_gate_up, block_n_down, warps, stages) `--sweep` times: small
for under 16 rows per expert, large above."""


def sweep(moe: CpuMoE, raw: torch.Tensor, tokens: list[int], k: int,
          repeats: int) -> list[dict[str, Any]]:
    """ms of each `SWEEP` config of the tile shape that T tokens get."""
    (part,) = moe.packed_groups()
    h, rows = moe.hidden, []
    for t in tokens:
        x, ids, weights = inputs(t, h, moe.num_experts, k, raw.device)
        small = tile_config(t * k, moe.num_experts) == kernel.SMALL_M
        for cfg in SWEEP["small" if small else "large"]:
            kernel.tile_config = lambda pairs, experts, cfg=cfg: TileConfig(*cfg)
            try:
                ms = gpu_ms(lambda x=x, ids=ids, weights=weights: packed_moe(
                    x, ids, weights, raw, part, moe.weight_format, h, moe.group_size), repeats)
            finally:
                kernel.tile_config = tile_config
            rows.append({"format": moe.weight_format, "tokens": t, "config": cfg,
                         "ms": round(ms, 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


PAIR_SWEEP_GATE_UP = [(32, 1, 4, 4), (16, 1, 4, 4), (16, 2, 4, 4), (16, 4, 4, 4), (32, 2, 4, 4),
                      (32, 4, 4, 4), (64, 4, 4, 4), (64, 8, 8, 4), (16, 2, 2, 4), (16, 4, 2, 4),
                      (32, 4, 2, 4), (16, 4, 4, 2), (32, 2, 4, 8)]
"""Gate/up shapes `--pair-sweep` times first, the format's down shape kept: (block_n_gate_up,
split_gate_up, warps_gate_up, k_unroll). At 8 pairs (S = 768) they give 192 to 1,536 programs."""

PAIR_SWEEP_DOWN = [(64, 1, 4), (32, 1, 4), (32, 2, 2), (64, 2, 4), (64, 3, 4), (64, 2, 2),
                   (128, 2, 4), (128, 3, 4), (128, 4, 8), (256, 4, 8)]
"""Then down shapes with the best gate/up one: (block_n_down, split_down, warps_down)."""

PAIR_SWEEP_WORDS = (32, 1, 64, 1, 4, 2, 4)
"""A shape `--pair-sweep int4` also times read by words (`PairConfig.int4_words`): the shipped
one with 2 gate/up warps, so a thread holds 4 words of a matrix a block, not 2."""


def pair_sweep(moe: CpuMoE, raw: torch.Tensor, tokens: list[int], k: int, bandwidth: float,
               repeats: int) -> list[dict[str, Any]]:
    """Graph ms of the pair kernels at each T for the format's `PAIR_CONFIGS` shape, then
    per launch shape of `PAIR_SWEEP_*` (down shapes on the best gate/up one), beside the
    bytes floor (the distinct experts routed to) and the largest relative difference from
    the format's current `PAIR_CONFIGS` shape (fp32 sums in another order: ~1e-6)."""
    (part,) = moe.packed_groups()
    fmt, h, e = moe.weight_format, moe.hidden, moe.num_experts
    cases = []
    for t in tokens:
        x, ids, w = inputs(t, h, e, k, raw.device)
        cases.append((t, x, ids, w, ids.unique().numel() * part.expert_bytes / bandwidth * 1e3))

    def run(cfg: PairConfig, x: torch.Tensor, ids: torch.Tensor,
            w: torch.Tensor) -> torch.Tensor:
        return packed_moe(x, ids, w, raw, part, fmt, h, moe.group_size, "pairs", cfg)

    base = PAIR_CONFIGS[fmt]
    refs = [run(base, *case[1:4]) for case in cases]
    rows: list[dict[str, Any]] = []

    def time_config(cfg: PairConfig) -> dict[str, Any]:
        row: dict[str, Any] = {"format": fmt, "config": dataclasses.astuple(cfg), "ms": {},
                               "floor_ms": {}, "max_rel_diff": 0.0}
        for (t, x, ids, w, floor), ref in zip(cases, refs, strict=True):
            row["ms"][t] = round(graph_ms(
                lambda x=x, ids=ids, w=w: run(cfg, x, ids, w), repeats), 4)
            row["floor_ms"][t] = round(floor, 4)
            diff = float((run(cfg, x, ids, w) - ref).norm() / ref.norm())
            row["max_rel_diff"] = max(row["max_rel_diff"], round(diff, 7))
        row["score"] = round(math.exp(sum(map(math.log, row["ms"].values())) / len(cases)), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    gate_up = [time_config(base)] + [time_config(dataclasses.replace(  # first: the one to beat
        base, block_n_gate_up=bn, split_gate_up=split, warps_gate_up=warps, k_unroll=unroll))
        for bn, split, warps, unroll in PAIR_SWEEP_GATE_UP]
    best = min(gate_up, key=lambda r: r["score"])
    for bn, split, warps in PAIR_SWEEP_DOWN:
        time_config(dataclasses.replace(PairConfig(*best["config"]), block_n_down=bn,
                                        split_down=split, warps_down=warps))
    if fmt != "bf16":  # the factored weights (no bf16 rounding: ~1e-3 from the current shape)
        fastest = min(rows, key=lambda r: r["score"])
        shapes = list(dict.fromkeys(tuple(r["config"]) for r in (rows[0], best, fastest)))
        for shape in shapes:
            time_config(dataclasses.replace(PairConfig(*shape), factored=True))
        if fmt == "int4":  # and read by words, on the same shapes and one of 2 gate/up warps
            for shape in dict.fromkeys([*shapes, PAIR_SWEEP_WORDS]):
                time_config(dataclasses.replace(PairConfig(*shape), factored=True,
                                                int4_words=True))
    return rows


def print_pair_sweep(rows: list[dict[str, Any]]) -> None:
    """Per format: the current shape (its first row), the best per T and the best overall
    (geometric mean over T), each against the bytes floor; then the `PAIR_CONFIGS` line."""
    print("| format | shape | T: graph ms (% of bytes floor) | vs current | max rel diff |")
    print("|---|---|---|---:|---:|")
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt]
        best = min(mine, key=lambda r: r["score"])
        picks = [("current", mine[0]), ("best", best)] + [
            (f"best at T={t}", min(mine, key=lambda r, t=t: r["ms"][t])) for t in mine[0]["ms"]]
        for name, r in picks:
            times = ", ".join(f"{t}: {ms} ({100 * r['floor_ms'][t] / ms:.0f} %)"
                              for t, ms in r["ms"].items())
            print(f"| {fmt} {name} | {r['config']} | {times} | "
                  f"{mine[0]['score'] / r['score']:.2f}x | {r['max_rel_diff']} |")
        print(f'    "{fmt}": PairConfig{tuple(best["config"])},  # PAIR_CONFIGS line')


def run_pair_sweep(args: argparse.Namespace, bandwidth: float) -> None:
    """`--pair-sweep`: the pair kernels' launch shapes per format; the JSON and the tables
    rewritten after each format (a call cut short keeps the formats done)."""
    rows: list[dict[str, Any]] = []
    tokens = [int(n) for n in args.pair_tokens.split(",")]
    result = {"shape": {"experts": args.experts, "hidden": args.hidden,
                        "intermediate": args.intermediate, "top_k": args.top_k},
              "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "rows": rows,
              "fields": [f.name for f in dataclasses.fields(PairConfig)],
              "device": torch.cuda.get_device_name(), "machine": machine_report()}
    for fmt in args.pair_sweep.split(","):
        start = time.perf_counter()
        moe = build_layer(fmt, args.experts, args.hidden, args.intermediate)
        (part,) = moe.packed_groups()
        raw = host_tensor(part).to("cuda")
        print(f"{fmt}: layer packed in {time.perf_counter() - start:.0f} s", flush=True)
        rows += pair_sweep(moe, raw, tokens, args.top_k, bandwidth, args.repeats)
        print(f"{fmt}: swept in {time.perf_counter() - start:.0f} s", flush=True)
        del raw
        torch.cuda.empty_cache()
        (args.out / "packed_moe_pair_sweep.json").write_text(json.dumps(result, indent=1))
        print_pair_sweep(rows)


def time_act_quant(moe: CpuMoE, raw: torch.Tensor, t: int, k: int,
                   repeats: int) -> dict[str, Any]:
    """One T: the sorted path's ms with bf16 math and with `act_quant`, the quantization of x
    and of a [T K, S] intermediate alone, and how far the two outputs differ."""
    (part,) = moe.packed_groups()
    fmt, e, h, i, g = (moe.weight_format, moe.num_experts, moe.hidden, moe.intermediate,
                       moe.group_size)
    assert g is not None, "int8 and fp8 layers have a group"
    x, ids, weights = inputs(t, h, e, k, raw.device)
    act = torch.randn(t * k, i, device=raw.device, dtype=torch.bfloat16)

    def run(quant: bool) -> torch.Tensor:
        return packed_moe(x, ids, weights, raw, part, fmt, h, g, "sorted", act_quant=quant)

    def quantize() -> None:
        quantize_rows(x, fmt, g, padded_hidden(h, g))
        quantize_rows(act, fmt, g, i)

    bf16, quantized = run(False), run(True)
    row = {"format": fmt, "group": g, "tokens": t, "block_m": tile_config(t * k, e).block_m,
           "flop_floor_ms": round(6 * h * i * t * k / BF16_PEAK * 1e3, 4),
           "bf16_ms": round(gpu_ms(lambda: run(False), repeats), 4),
           "act_quant_ms": round(gpu_ms(lambda: run(True), repeats), 4),
           "quantize_ms": round(gpu_ms(quantize, repeats), 4),
           "rel_diff": round(float((quantized - bf16).norm() / bf16.norm()), 5)}
    row["speedup"] = round(row["bf16_ms"] / row["act_quant_ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def run_act_quant(args: argparse.Namespace) -> None:
    """`--act-quant`: both maths of the sorted path per format and T, a table and JSON."""
    rows: list[dict[str, Any]] = []
    tokens = [int(n) for n in args.act_quant_tokens.split(",")]
    for fmt in args.act_quant.split(","):
        moe = build_layer(fmt, args.experts, args.hidden, args.intermediate)
        (part,) = moe.packed_groups()
        raw = host_tensor(part).to("cuda")
        rows += [time_act_quant(moe, raw, t, args.top_k, args.repeats) for t in tokens]
        del raw
        torch.cuda.empty_cache()
    result = {"shape": {"experts": args.experts, "hidden": args.hidden,
                        "intermediate": args.intermediate, "top_k": args.top_k},
              "rows": rows, "device": torch.cuda.get_device_name(), "machine": machine_report()}
    (args.out / "packed_moe_act_quant.json").write_text(json.dumps(result, indent=1))
    print("| format | G | T | bf16 math ms | act_quant ms | speedup | quantize ms | rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['group']} | {r['tokens']} | {r['bf16_ms']} | "
              f"{r['act_quant_ms']} | {r['speedup']}x | {r['quantize_ms']} | {r['rel_diff']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="bf16,int8,int4,fp8")
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", default="", help="formats whose tile configs are swept")
    parser.add_argument("--pair-sweep", default="",
                        help="formats whose pair kernel shapes are swept (nothing else runs)")
    parser.add_argument("--pair-tokens", default="1,8,16", help="T values of --pair-sweep")
    parser.add_argument("--act-quant", default="",
                        help="formats (int8, fp8) whose sorted path is timed with both maths "
                             "(nothing else runs)")
    parser.add_argument("--act-quant-tokens", default="512,4096,16384",
                        help="T values of --act-quant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16 peak taken "
          f"{BF16_PEAK / 1e12:.0f} TFLOP/s", flush=True)
    if args.pair_sweep:
        run_pair_sweep(args, bandwidth)
        return
    if args.act_quant:
        run_act_quant(args)
        return
    rows: list[dict[str, Any]] = []
    swept: list[dict[str, Any]] = []
    for fmt in args.formats.split(","):
        start = time.perf_counter()
        moe = build_layer(fmt, e, h, i)
        (part,) = moe.packed_groups()  # one NUMA group on the device machine
        raw = host_tensor(part).to("cuda")
        print(f"{fmt}: layer packed in {time.perf_counter() - start:.1f} s, "
              f"{part.expert_bytes} bytes per expert", flush=True)
        for t in (int(n) for n in args.tokens.split(",")):
            rows.append(time_tokens(moe, raw, t, k, bandwidth, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
        if fmt in args.sweep.split(","):
            swept += sweep(moe, raw, [1, 64, 512, 4096], k, args.repeats)
        del raw
        torch.cuda.empty_cache()
    result = {"shape": {"experts": e, "hidden": h, "intermediate": i, "top_k": k},
              "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
              "bf16_peak_tflop_s": BF16_PEAK / 1e12, "rows": rows, "sweep": swept,
              "device": torch.cuda.get_device_name(), "machine": machine_report()}
    (args.out / "packed_moe.json").write_text(json.dumps(result, indent=1))
    print("| format | T | bytes floor ms | FLOP floor ms | packed ms (graph) | "
          "unpack+GEMM ms | speedup | of floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['tokens']} | {r['bytes_floor_ms']} | {r['flop_floor_ms']} "
              f"| {r['packed_ms']} ({r.get('packed_graph_ms', '')}) | {r['unpack_gemm_ms']} | "
              f"{r['speedup']} | {r['of_floor']} |")
    print("| format | T | sorted ms (graph) | pairs ms (graph) | graph speedup |")
    print("|---|---:|---:|---:|---:|")
    for r in (r for r in rows if "pairs_ms" in r):
        print(f"| {r['format']} | {r['tokens']} | {r['sorted_ms']} ({r['sorted_graph_ms']}) | "
              f"{r['pairs_ms']} ({r['pairs_graph_ms']}) | "
              f"{r['sorted_graph_ms'] / r['pairs_graph_ms']:.2f}x |")
    print("swept:", json.dumps(swept))


if __name__ == "__main__":
    main()
