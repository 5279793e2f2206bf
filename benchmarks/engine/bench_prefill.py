"""Prefill sweep of one real shape with random weights: where the routed experts run, and how fast.

For each prompt length: the engine's choice (`auto`, by this machine's measured costs), the
experts on the CPU (AMX / AVX-512), streamed to the GPU layer by layer
(engine/placement/layer_stream.py) and split (the first experts of each layer on the GPU, the rest
on the CPU at once), each with time-to-first-token and tok/s and the GPU's expert count per layer,
beside the floors measured in the same run: PCIe (packed expert bytes per pass over the pinned
host-to-device bandwidth), the GPU's expert compute with the weights resident (unpack + grouped GEMM
of one layer, times the layers; attention excluded) and, with `--resident-pass`, the whole pass
(attention included) with every layer's packed experts resident on the GPU: the pass without copies.
Also the distinct experts each layer's router picks per 512-token chunk of a 4K random prompt
(llama.cpp copies only those at its default ubatch; with `--count-experts` taken from its count
of that prompt, not counted again). Prints a table, writes JSON and a PNG of tok/s against prompt
length (with llama.cpp's rows when given).

    python benchmarks/engine/bench_prefill.py --shape qwen3-30b-a3b --weight-format int8 --out DIR \
        [--lengths 128,512,...] [--modes auto,gpu,...] [--cpu-max 4096] [--llamacpp FILE.json]

`--model PATH` times a real file instead of a random-weight shape (a GGUF, converted as `hetmoe
bench MODEL` converts it, or with `--weight-format`/`--group` into that packed format: the very
GGUF llama.cpp ran). `--count-experts` adds, per length, the distinct routed experts per MoE layer
per `--ubatch` of a random-id prompt (llama-bench's prompt), the bytes a copy of only those
experts moves (ours packed; the GGUF's blocks with --model GGUF) and the PCIe floor it implies
(hetmoe/bench/expert_count.py); `--count-only` skips the timing (runs without a GPU too; the
experts stay in host memory: counting reads the routers only).

`--split-k 96,104,...` also times, per length, passes that stream exactly that many experts per
layer (the rest on the CPU at once), the planner's pick set aside: the split's measured curve,
against which the cost model's k and the tuner's choice are judged.

HETMOE_GPU_EXPERTS=unpack times the torch unpack + grouped GEMM instead of the packed kernels
(the A/B of docs/benchmarks/gpu_kernels.md; the file name gets an `_unpack` suffix).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from hetmoe.bench import expert_count, measure
from hetmoe.bench.bench_model import open_bench_model
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.layer_stream import LayerStreamer
from hetmoe.experts.routed_mlp import routed_mlp
from hetmoe.machine import machine_report

MODES = ("auto", "gpu", "split", "cpu")
"""The prefill_experts modes timed per length, in this order (auto first: its tuner's turns)."""


@torch.inference_mode()
def resident_compute_s(streamer: LayerStreamer, tokens: int, top_k: int, hidden: int) -> float:
    """GPU seconds of a pass's expert work with the weights already on the GPU: layer 0's
    experts on `tokens` random rows as the streamer computes them (the packed kernels, or
    unpack + grouped GEMM with HETMOE_GPU_EXPERTS=unpack), median of 5, times the MoE layers."""
    streamer.begin(tokens, top_k)
    torch.cuda.current_stream().wait_event(streamer.copied[0])
    moe = streamer.cpu[0]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.randint(0, moe.num_experts, (tokens, top_k), device="cuda", generator=g)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if streamer.packed_kernel:
            streamer.computed(0, x, ids, weights)
        else:
            routed_mlp(x, ids, weights, streamer.unpacked(0), streamer.grouped)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    return sorted(times[1:])[2] * len(streamer.cpu)


def resident_pass(runner: ModelRunner, rows: list[dict[str, Any]], vocab: int,
                  repeats: int) -> None:
    """Adds each row's `resident_pass_s`: the whole prefill (attention included) with every
    layer's packed experts resident on the GPU (the engine's placement of them all), so
    nothing is copied (skipped, with a note, when they do not fit)."""
    overlap = runner.overlap
    assert overlap is not None and overlap.streamer is not None
    need = sum(overlap.streamer.layer_bytes)
    overlap.streamer = None  # its staging buffers go before the experts come
    torch.cuda.empty_cache()
    plan = runner.place(need)
    if not plan.everything:
        print(f"resident pass skipped: {need / 1e9:.1f} GB of experts, "
              f"{plan.bytes / 1e9:.1f} GB fit", flush=True)
        runner.place(0)
        return
    try:
        for row in rows:
            n = row["tokens"]
            tok_s = measure.prefill_speed(runner, n, vocab, repeats)
            row["resident_pass_s"] = round(n / tok_s, 4)
            if "gpu_ttft_s" in row:
                row["gpu_over_resident"] = round(row["gpu_ttft_s"] / row["resident_pass_s"], 3)
            print(json.dumps({"tokens": n, "resident_pass_s": row["resident_pass_s"]}),
                  flush=True)
    finally:
        runner.place(0)
        torch.cuda.empty_cache()


def unpack_row(runner: ModelRunner, row: dict[str, Any], n: int, top_k: int, config: Any,
               repeats: int) -> None:
    """Adds the GPU stream's tok/s and the resident compute with the old unpack path."""
    overlap = runner.overlap
    assert overlap is not None and overlap.streamer is not None
    streamer, auto, before = overlap.streamer, runner.config, overlap.streamer.packed_kernel
    streamer.packed_kernel, runner.config = False, dataclasses.replace(auto, prefill_experts="gpu")
    try:
        tok_s = measure.prefill_speed(runner, n, config.vocab_size, repeats)
        row["gpu_unpack_tok_s"] = round(tok_s, 1)
        row["resident_compute_unpack_s"] = round(
            resident_compute_s(streamer, n, top_k, config.hidden_size), 4)
    finally:
        streamer.packed_kernel, runner.config = before, auto
    print(json.dumps({"tokens": n, "gpu_unpack_tok_s": row["gpu_unpack_tok_s"],
                      "resident_compute_unpack_s": row["resident_compute_unpack_s"]}), flush=True)


def split_k_row(runner: ModelRunner, row: dict[str, Any], n: int, ks: list[int], vocab: int,
                repeats: int) -> None:
    """Adds `split_k_tok_s` {k: tok/s}: passes of n tokens streaming exactly k experts per layer
    (k >= the experts per layer: all of them), each k after a pass of warm-up."""
    planner = runner.planner
    assert planner is not None
    row["split_k_tok_s"] = {}
    for k in ks:
        with mock.patch.object(planner, "_pick", return_value=(min(k, planner.most), False)):
            measure.prefill_speed(runner, n, vocab, 1)
            row["split_k_tok_s"][k] = round(measure.prefill_speed(runner, n, vocab, repeats), 1)
    print(json.dumps({"tokens": n, "split_k_tok_s": row["split_k_tok_s"]}), flush=True)


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, str, float, Any]:
    """(model, transformers config, label, build seconds, GGUF path or None) of `--model` (as
    `hetmoe bench MODEL` loads it) or of `--shape` with random weights."""
    start = time.perf_counter()
    if args.model is not None:
        loaded = open_bench_model(args.model, device, args.weight_format, args.group)
        label = loaded.gguf.stem if loaded.gguf is not None else Path(args.model).name
        return (loaded.model, loaded.config, label, time.perf_counter() - start, loaded.gguf)
    config = shape_config(args.shape, args.num_layers)
    model = build_random_model(config, device, torch.bfloat16, "cpu", args.weight_format)
    return model, config, args.shape, time.perf_counter() - start, None


def count_only(args: argparse.Namespace, lengths: list[int]) -> dict[str, Any]:
    """`--count-only`: the expert counts alone (attention on the GPU when there is one, else
    the CPU). Counting reads the routers only: every expert stays in host memory, as in the
    sweep (the default budget would first place experts on the GPU for nothing)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, config, label, build_s, gguf = build(args, device)
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, device, dtype, 1, max(lengths) + 64,
                         EngineConfig(gpu_expert_bytes=0))
    h2d = measure.h2d_bandwidth(device) if device.type == "cuda" else None
    rows = expert_count.count_rows(runner, config, lengths, args.ubatch, h2d, gguf)
    result = {"model": label, "device": device.type, "layers": config.num_hidden_layers,
              "build_s": round(build_s, 1), "h2d_gb_s": round(h2d / 1e9, 1) if h2d else None,
              "expert_counts": rows, "machine": machine_report()}
    (args.out / f"experts_{label}.json").write_text(json.dumps(result, indent=1))
    expert_count.print_counts(rows)
    return result


def plot(rows: list[dict[str, Any]], peer: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = [r["tokens"] for r in rows]
    for key, label in (("auto_tok_s", "hetmoe (auto)"), ("gpu_tok_s", "hetmoe GPU stream"),
                       ("split_tok_s", "hetmoe CPU+GPU split"), ("cpu_tok_s", "hetmoe CPU"),
                       ("pcie_floor_tok_s", "PCIe floor")):
        points = [(n, r[key]) for n, r in zip(lengths, rows, strict=True) if r.get(key)]
        if points:
            style = "--" if key == "pcie_floor_tok_s" else "-o"
            ax.plot(*zip(*points, strict=True), style, label=label)
    for series in peer:
        ax.plot(series["tokens"], series["tok_s"], "-s", label=series["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="random-weight shape (default qwen3-30b-a3b)")
    parser.add_argument("--model", help="a GGUF file or checkpoint/converted directory instead "
                                        "of --shape, loaded as `hetmoe bench MODEL` loads it")
    parser.add_argument("--weight-format",
                        help="expert format: of the random shape (default int8); with --model "
                             "a GGUF is converted into it (default: the loader's choice)")
    parser.add_argument("--group", type=int,
                        help="with --model GGUF and --weight-format: its quantization group")
    parser.add_argument("--count-experts", action="store_true",
                        help="count distinct routed experts per layer per --ubatch tokens of a "
                             "random-id prompt, and the used-experts-only copy's bytes and floor")
    parser.add_argument("--count-only", action="store_true",
                        help="only count experts (no timing; runs on the CPU without a GPU)")
    parser.add_argument("--ubatch", type=int, default=expert_count.UBATCH,
                        help="tokens per ubatch for --count-experts (llama.cpp's default 512)")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--lengths", default="128,512,1024,2048,4096,8192,16384")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="prefill_experts modes timed per length (the engine's pick: auto)")
    parser.add_argument("--cpu-max", type=int, default=4096, help="longest prompt timed on CPU")
    parser.add_argument("--split-max", type=int, default=8192,
                        help="longest prompt timed with every layer split between CPU and GPU")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resident-pass", action="store_true",
                        help="also time each length with every layer's experts resident on "
                             "the GPU (needs the packed experts' bytes free on it)")
    parser.add_argument("--llamacpp", type=Path, help="JSON rows [{label, tokens, tok_s}]")
    parser.add_argument("--ab-unpack", action="store_true",
                        help="also time the GPU stream and the resident compute with the torch "
                             "unpack + grouped GEMM (the path the packed kernels replaced)")
    parser.add_argument("--split-k", default="",
                        help="streamed experts per layer (comma-separated) also timed per length, "
                             "the rest on the CPU: the split's curve")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    check_args(parser, args)
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.count_only:
        count_only(args, lengths)
        return
    if not torch.cuda.is_available():
        parser.error("the prefill sweep needs a CUDA GPU (--count-only counts experts without)")
    device = torch.device("cuda")
    model, config, label, build_s, gguf = build(args, device)
    window = max(lengths) + 64
    dtype = next(model.parameters()).dtype if args.model else torch.bfloat16
    # No resident experts: the sweep times every expert streamed (bench_gpu_experts.py times
    # prefill per GPU expert budget).
    runner = ModelRunner(model, device, dtype, 1, window, EngineConfig(gpu_expert_bytes=0))
    overlap, planner = runner.overlap, runner.planner
    assert overlap is not None and planner is not None and planner.can_stream(), \
        "GPU prefill needs packed CPU experts"
    h2d = measure.h2d_bandwidth(device)
    costs = planner.load_costs()  # loaded (or measured) when the runner started
    print(f"costs per expert: {costs}", flush=True)
    auto = runner.config
    top_k = int(config.num_experts_per_tok)
    rows = []
    for n in lengths:
        row: dict[str, Any] = {"tokens": n}
        for name in args.modes:
            if (name == "cpu" and n > args.cpu_max) or (name == "split" and n > args.split_max):
                continue
            row[f"{name}_gpu_experts"] = planner.gpu_experts(n, name)
            runner.config = dataclasses.replace(auto, prefill_experts=name)
            try:
                if name == "auto":  # its tuner's turns first (not timed): then what it settled on
                    row["auto_tuning_passes"] = measure.settle_prefill(runner, n, config.vocab_size)
                tok_s = measure.prefill_speed(runner, n, config.vocab_size, args.repeats)
            except Exception as exc:  # noqa: BLE001 -- one strategy's failure is a row's note
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"{name} at {n} tokens failed: {row[f'{name}_error']}", flush=True)
                continue
            row[f"{name}_ttft_s"], row[f"{name}_tok_s"] = round(n / tok_s, 4), round(tok_s, 1)
            if name == "auto":  # after its passes: what the tuner settled on
                row["auto_gpu_experts"] = planner.gpu_experts(n, name)
        runner.config = auto
        assert overlap.streamer is not None
        pass_bytes = overlap.streamer.bytes_per_pass()
        row["pcie_floor_tok_s"] = round(n * h2d / pass_bytes, 1)
        compute = resident_compute_s(overlap.streamer, n, top_k, config.hidden_size)
        row["resident_compute_s"] = round(compute, 4)
        row["floor_s"] = round(max(pass_bytes / h2d, compute), 4)
        if args.ab_unpack:
            unpack_row(runner, row, n, top_k, config, args.repeats)
        if args.split_k:
            split_k_row(runner, row, n, args.split_k, config.vocab_size, args.repeats)
        if "gpu_ttft_s" in row:
            row["gpu_of_floor"] = round(row["floor_s"] / row["gpu_ttft_s"], 3)
            row["of_pcie_floor"] = round(row["gpu_tok_s"] / row["pcie_floor_tok_s"], 3)
        if "cpu_tok_s" in row and "gpu_tok_s" in row:
            row["gpu_over_cpu"] = round(row["gpu_tok_s"] / row["cpu_tok_s"], 2)
        if "split_tok_s" in row and "gpu_tok_s" in row:
            row["split_over_stream"] = round(row["split_tok_s"] / row["gpu_tok_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    grouped = bool(overlap.streamer.grouped) if overlap.streamer else None
    packed_kernel = bool(overlap.streamer.packed_kernel) if overlap.streamer else None
    if args.resident_pass:
        resident_pass(runner, rows, config.vocab_size, args.repeats)
    counts = (expert_count.count_rows(runner, config, lengths, args.ubatch, h2d, gguf)
              if args.count_experts else None)
    result = {
        "shape": label, "weight_format": args.weight_format, "model": args.model,
        "layers": config.num_hidden_layers, "experts": int(config.num_experts),
        "build_s": round(build_s, 1), "h2d_gb_s": round(h2d / 1e9, 1),
        "packed_bytes_per_pass": pass_bytes,
        "grouped_gemm": grouped, "packed_kernels": packed_kernel,
        "split_costs": dataclasses.asdict(costs),
        "distinct_experts_per_512": expert_count.distinct_summary(
            runner, config, min(4096, window - 64), counts),
        "rows": rows, "machine": machine_report(),
    }
    if counts is not None:
        result["expert_counts"] = counts
    peer = json.loads(args.llamacpp.read_text()) if args.llamacpp else []
    result["llamacpp"] = peer
    fmt = args.weight_format or "loaded"
    stem = f"prefill_{label}_{fmt}" + ("" if packed_kernel else "_unpack")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(rows, peer, args.out / f"{stem}.png", f"{label} {fmt} prefill")
    print(f"| tokens | auto tok/s (GPU experts) | GPU stream | CPU+GPU split (GPU experts) | "
          f"CPU | PCIe floor tok/s | resident compute s | resident pass s | "
          f"(H2D {result['h2d_gb_s']} GB/s, {result['packed_bytes_per_pass'] / 1e9:.1f} GB/pass)")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r.get('auto_tok_s', '')} ({r.get('auto_gpu_experts')}) | "
              f"{r.get('gpu_tok_s', '')} | {r.get('split_tok_s', '')} "
              f"({r.get('split_gpu_experts', '')}) | {r.get('cpu_tok_s', '')} | "
              f"{r['pcie_floor_tok_s']} | {r['resident_compute_s']} | "
              f"{r.get('resident_pass_s', '')} |")
    print("split costs (s per expert):", result["split_costs"])
    print("distinct experts per layer per 512 tokens:", result["distinct_experts_per_512"])
    if args.count_experts:
        expert_count.print_counts(result["expert_counts"])


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--model or --shape (default qwen3-30b-a3b); --group only for a converted GGUF."""
    if args.model is not None and (args.shape is not None or args.num_layers is not None):
        parser.error("--model loads a file: --shape and --num-layers are for random weights")
    if args.model is None:
        args.shape = args.shape or "qwen3-30b-a3b"
        args.weight_format = args.weight_format or "int8"
    if args.group is not None and (args.model is None or args.weight_format is None):
        parser.error("--group applies with --model GGUF and --weight-format")
    if args.ubatch < 1:
        parser.error(f"--ubatch must be >= 1 token, got {args.ubatch}")
    try:
        args.split_k = [int(k) for k in args.split_k.split(",") if k]
    except ValueError:
        parser.error(f"--split-k takes comma-separated expert counts, got {args.split_k!r}")
    if any(k < 0 for k in args.split_k):
        parser.error(f"--split-k counts must be >= 0, got {args.split_k}")
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes takes some of {', '.join(MODES)}, got "
                     f"{', '.join(unknown) or 'none'}")


if __name__ == "__main__":
    main()
