"""Can the GPU read CPU-resident experts over PCIe (zero-copy) while the CPU reads the others?

Decode with experts on the CPU is bound by host DRAM reads while PCIe sits idle. The idea to
weigh: the GPU computes some of a token's CPU experts straight from pinned host memory (a pinned
page's address is valid in a kernel under unified addressing) while the CPU computes the rest.
It pays if the GPU pulls a good share of PCIe that way and the CPU's rate holds meanwhile. Three
parts, each written to the JSON as it ends:

1. read: GB/s of a Triton byte-sum kernel (`sum_bytes_kernel`, per `--shapes`) over `--gib` of
   (a) device memory, (b) a pinned host tensor passed to Triton as it is (the launcher's
   cuPointerGetAttribute check), (b') the same pages as a CUDA tensor (`gpu_view`), beside
   (c) `copy_` host -> device from the same pinned buffer on a side stream.
2. overlap: the best zero-copy read, and the copy, alone and while the CPU decodes: `CpuMoE`
   calls (1 token, top-k random experts) over `--cpu-layers` real-shape INT8 layers on the
   process pool (all cores but one), in a thread; GB/s of both sides, alone and together.
3. pairs: `packed_moe` (path "pairs") on one real-shape INT8 layer, the packed bytes in device
   memory, in a pinned copy (cudaHostAlloc) and in the layer's own mapping registered as the
   engine registers it (`pinned_groups`, cudaHostRegister), both seen by the GPU through
   `gpu_view`: ms a call (a CUDA graph of `--calls` calls, each its own random route).

    python benchmarks/kernels/bench_zero_copy.py --json F [--gib 1 --cpu-layers 4]
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from bench_packed_moe import gpu_ms, graph_ms, random_weights

from hetmoe import _cpu
from hetmoe.bench.shapes import routed_expert_shape
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.gpu_view import gpu_view
from hetmoe.experts.packed_layout import host_tensor
from hetmoe.kernels.packed_moe import packed_moe
from hetmoe.machine import machine_report

SHAPES = ("1,4,4096,4", "4,4,4096,4", "8,8,8192,2", "16,4,2048,8", "32,4,4096,1")
"""Default read launch shapes: programs per SM, warps, bytes a load step, load steps in flight."""

LANE_LIMIT = (2**31 - 1) // 255
"""Bytes one lane may add up in its int32 accumulator (255 each) without overflow."""


class ReadShape(NamedTuple):
    """The byte-sum kernel's launch shape (a NamedTuple: the script is loaded unregistered as a
    module in tests, where a dataclass cannot resolve its annotations)."""

    per_sm: int  # programs per streaming multiprocessor (grid = per_sm x SMs)
    warps: int  # warps a program
    block: int  # bytes one load step of a program reads (a power of two, >= 16 a thread)
    unroll: int  # load steps issued before their sums are needed (in flight: block x unroll)


def parse_shape(text: str) -> ReadShape:
    """ReadShape from "per_sm,warps,block,unroll"; ValueError naming the field."""
    fields = text.split(",")
    if len(fields) != 4 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"--shapes {text!r}: four positive integers per_sm,warps,block,unroll")
    per_sm, warps, block, unroll = map(int, fields)
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"--shapes {text!r}: warps must be 1, 2, 4, 8 or 16, got {warps}")
    if block & (block - 1) or block < 16 * 32 * warps:
        raise ValueError(f"--shapes {text!r}: block must be a power of two of at least "
                         f"16 bytes a thread ({16 * 32 * warps} at {warps} warps), got {block}")
    return ReadShape(per_sm, warps, block, unroll)


@triton.jit
def sum_bytes_kernel(src, out, n, iters, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """out[program] = sum of the uint8 bytes src[0:n] the program reads: chunks of BLOCK x UNROLL
    bytes, grid-strided (program p takes chunks p, p + grid, ...); int64 offsets (n > 2 GiB)."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(iters):
        base = (i * grid + pid).to(tl.int64) * (BLOCK * UNROLL)
        for u in tl.static_range(UNROLL):  # UNROLL independent loads before the adds
            offs = base + u * BLOCK + lanes
            acc += tl.load(src + offs, mask=offs < n, other=0).to(tl.int32)
    tl.store(out + pid, tl.sum(acc.to(tl.int64), axis=0))


def sum_bytes(src: torch.Tensor, shape: ReadShape, programs: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-program int64 sums [programs] of contiguous uint8 `src` (any device Triton can read:
    GPU memory, pinned host memory, a CPU tensor under the interpreter); their sum is src's."""
    if src.dtype != torch.uint8 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"sum_bytes: src must be a contiguous 1-D uint8 tensor, got "
                         f"{src.dtype} {list(src.shape)}")
    chunk = shape.block * shape.unroll
    iters = math.ceil(src.numel() / (programs * chunk))
    if iters * shape.unroll > LANE_LIMIT:
        raise ValueError(f"sum_bytes: {src.numel()} bytes over {programs} programs of block "
                         f"{shape.block} overflow a lane's int32 sum; use more programs")
    if out is None:
        out = torch.empty(programs, dtype=torch.int64, device=src.device)
    sum_bytes_kernel[(programs,)](src, out, src.numel(), iters, BLOCK=shape.block,
                                  UNROLL=shape.unroll, num_warps=shape.warps)
    return out


def read_rows(host: torch.Tensor, shapes: list[ReadShape], sms: int,
              repeats: int) -> list[dict[str, Any]]:
    """Part 1: GB/s per (source, shape), each sum checked against torch's; and the copy."""
    dev = host.to("cuda")
    want = int(dev.sum(dtype=torch.int64))
    # the view first: were the launcher's check to pass a pointer the GPU then faults on, the
    # rows before it are printed already
    sources = {"device": dev, "pinned_view": uint8_view(host), "pinned_direct": host}
    rows = []
    for name, src in sources.items():
        for shape in shapes:
            row: dict[str, Any] = {"source": name, "shape": list(shape)}
            out = torch.empty(shape.per_sm * sms, dtype=torch.int64, device="cuda")
            try:
                got = int(sum_bytes(src, shape, out.numel(), out).sum())
                if got != want:
                    raise AssertionError(f"{name} {shape}: sum {got}, torch's {want}")
                ms = gpu_ms(lambda s=src, sh=shape, o=out: sum_bytes(s, sh, o.numel(), o),
                            repeats)
                row["gb_s"] = round(host.numel() / ms / 1e6, 2)
            except ValueError as e:  # Triton's launcher refusing a host pointer: the answer
                row["error"] = str(e)
            rows.append(row)
            print(json.dumps(row), flush=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ms = gpu_ms(lambda: dev.copy_(host, non_blocking=True), repeats)
    rows.append({"source": "copy_h2d", "shape": None, "gb_s": round(host.numel() / ms / 1e6, 2)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


class CpuDecode:
    """CPU experts decoding in a thread: one `CpuMoE` call a step (1 token, k random experts),
    layer after layer; each call's (start, end, bytes of distinct experts read) recorded."""

    def __init__(self, layers: list[CpuMoE], k: int, routes: int = 256) -> None:
        self.layers = layers
        e, h = layers[0].num_experts, layers[0].hidden
        g = torch.Generator().manual_seed(0)
        self.routes = [torch.randperm(e, generator=g)[:k].view(1, k) for _ in range(routes)]
        self.x, self.w = torch.randn(1, h, generator=g).bfloat16(), torch.full((1, k), 1 / k)
        self.expert_bytes = sum(p.expert_bytes for p in layers[0].packed_groups())
        self.stop = threading.Event()
        self.calls: list[tuple[float, float, int]] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        step = 0
        while not self.stop.is_set():
            ids = self.routes[step % len(self.routes)]
            start = time.perf_counter()
            self.layers[step % len(self.layers)].forward(self.x, ids, self.w)
            self.calls.append((start, time.perf_counter(), ids.numel() * self.expert_bytes))
            step += 1

    def __enter__(self) -> CpuDecode:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def rate(self, t0: float, t1: float) -> float:
        """Bytes/s of the calls that ran wholly within [t0, t1] (over their summed time)."""
        inside = [(b - a, n) for a, b, n in self.calls if a >= t0 and b <= t1]
        if not inside:
            raise RuntimeError(f"CpuDecode: no call ran wholly within the {t1 - t0:.3f} s window")
        return sum(n for _, n in inside) / sum(s for s, _ in inside)


def overlap(gpu: Callable[[], object], gpu_bytes: int, layers: list[CpuMoE], k: int,
            seconds: float, warm: float = 0.3) -> dict[str, float]:
    """Part 2 for one GPU reader: its GB/s and the CPU decode's, alone and together (the GPU
    enqueues ~`seconds` of passes while the CPU thread runs; both rates over that window)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gpu_pass(passes: int) -> float:
        start.record()
        for _ in range(passes):
            gpu()
        end.record()
        end.synchronize()
        return passes * gpu_bytes / (start.elapsed_time(end) / 1e3)

    gpu()
    alone = gpu_pass(3)
    passes = max(3, math.ceil(seconds * alone / gpu_bytes))
    with CpuDecode(layers, k) as cpu:
        time.sleep(warm + seconds)
    cpu_alone = cpu.rate(cpu.calls[0][0] + warm, math.inf)
    with CpuDecode(layers, k) as cpu:
        time.sleep(warm)
        t0 = time.perf_counter()
        together = gpu_pass(passes)
        t1 = time.perf_counter()
    cpu_together = cpu.rate(t0, t1)
    return {"gpu_alone_gb_s": round(alone / 1e9, 2), "gpu_with_cpu_gb_s": round(together / 1e9, 2),
            "cpu_alone_gb_s": round(cpu_alone / 1e9, 2),
            "cpu_with_gpu_gb_s": round(cpu_together / 1e9, 2),
            "sum_together_gb_s": round((together + cpu_together) / 1e9, 2),
            "gain_over_cpu": round((together + cpu_together) / cpu_alone, 3)}


def int8_layers(count: int, experts: int, hidden: int, inter: int) -> list[CpuMoE]:
    """`count` INT8 layers of the same `random_weights`, each in its own memory."""
    ws = random_weights(experts, hidden, inter)
    layers = [CpuMoE(experts, hidden, inter, "int8") for _ in range(count)]
    for layer in layers:
        layer.load(*ws)
    return layers


def uint8_view(host: torch.Tensor) -> torch.Tensor:
    """Pinned uint8 `host` as a uint8 CUDA tensor over the same pages (`gpu_view` of its fp32
    reading), so `packed_moe`'s device check passes; its bytes are read over PCIe."""
    if host.numel() % 4:
        raise ValueError(f"uint8_view: {host.numel()} bytes are not whole fp32 words")
    return gpu_view(host.view(torch.float32), torch.device("cuda")).view(torch.uint8)


def pair_rows(moe: CpuMoE, sources: dict[str, Callable[[], torch.Tensor]], tokens: list[int],
              k: int, calls: int, repeats: int,
              timer: Callable[[Callable[[], Any], int], float] = graph_ms) -> list[dict[str, Any]]:
    """Part 3: ms a `packed_moe` pairs call per (source of the packed bytes, T); a timed graph
    holds `calls` calls, each on its own random route. Every source's outputs must equal the
    first's (the same kernel on the same bytes, the down kernel's atomics' order aside)."""
    (part,) = moe.packed_groups()
    rows = []
    for t in tokens:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, moe.hidden, generator=g).bfloat16()
        ids = [torch.rand(t, moe.num_experts, generator=g).topk(k, dim=1).indices
               for _ in range(calls)]
        w = torch.rand(t, k, generator=g)
        first: list[torch.Tensor] = []
        for name, source in sources.items():
            row: dict[str, Any] = {"source": name, "tokens": t}
            try:
                raw = source()
            except (RuntimeError, ValueError) as e:  # e.g. the registration refused
                rows.append({**row, "error": str(e)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            dev = raw.device
            xs, ws = x.to(dev), w.to(dev)
            routes = [i.to(dev) for i in ids]
            outs: list[torch.Tensor] = []

            def run(raw: torch.Tensor = raw, xs: torch.Tensor = xs, ws: torch.Tensor = ws,
                    routes: list[torch.Tensor] = routes, outs: list[torch.Tensor] = outs) -> None:
                outs[:] = [packed_moe(xs, i, ws, raw, part, moe.weight_format, moe.hidden,
                                      moe.group_size, "pairs") for i in routes]

            ms = timer(run, repeats) / calls
            if first:
                pairs = zip(outs, first, strict=True)
                diff = max(float((a - b).norm() / b.norm()) for a, b in pairs)
                if diff > 1e-5:
                    raise AssertionError(f"pairs from {name} T={t}: outputs differ from "
                                         f"{next(iter(sources))}'s by {diff:.2e} (relative)")
            else:
                first = [o.clone() for o in outs]
            read = sum(i.unique().numel() for i in ids) / calls * part.expert_bytes
            rows.append({**row, "ms": round(ms, 4), "gb_s": round(read / ms / 1e6, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_tables(report: dict[str, Any]) -> None:
    """The three parts as markdown tables (a part not run yet is left out)."""
    print("| read of pinned/device bytes | shape (per SM, warps, block, unroll) | GB/s |")
    print("|---|---|---:|")
    for r in report.get("read", []):
        shape = "-" if r["shape"] is None else tuple(r["shape"])
        print(f"| {r['source']} | {shape} | {r.get('gb_s', r.get('error'))} |")
    if "overlap" in report:
        print("\n| GPU reader | GPU alone | GPU with CPU | CPU alone | CPU with GPU | "
              "both together | together / CPU alone |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, o in report["overlap"].items():
            print(f"| {name} | {o['gpu_alone_gb_s']} | {o['gpu_with_cpu_gb_s']} | "
                  f"{o['cpu_alone_gb_s']} | {o['cpu_with_gpu_gb_s']} | {o['sum_together_gb_s']} | "
                  f"{o['gain_over_cpu']:.2f}x |")
    if "pairs" in report:
        print("\n| pairs: packed bytes in | T | ms a call | GB/s of experts read |")
        print("|---|---:|---:|---:|")
        for r in report["pairs"]:
            value = f"{r['ms']} | {r['gb_s']}" if "ms" in r else f"{r['error']} | -"
            print(f"| {r['source']} | {r['tokens']} | {value} |")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[ReadShape], list[int]]:
    """The arguments, every one checked before any GPU work (argparse errors naming them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of the read and copy buffers")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES),
                   help="read shapes per_sm,warps,block,unroll")
    p.add_argument("--shape", default="qwen3-30b-a3b", help="the real layer's shape")
    p.add_argument("--cpu-layers", type=int, default=4,
                   help="INT8 layers the CPU decodes over (their bytes well past the LLC)")
    p.add_argument("--seconds", type=float, default=2.0, help="each overlap window")
    p.add_argument("--tokens", default="1,4", help="part 3's T values")
    p.add_argument("--calls", type=int, default=16, help="part 3's calls a timed graph")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        routed_expert_shape(args.shape)
    except (ValueError, KeyError) as e:
        p.error(str(e))
    if not 1 / 64 <= args.gib <= 16:
        p.error(f"--gib must be between 1/64 and 16, got {args.gib}")
    for name in ("cpu_layers", "calls", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.seconds > 0:
        p.error(f"--seconds must be positive, got {args.seconds}")
    tokens = [int(n) for n in args.tokens.split(",") if n.strip().isdigit() and int(n) > 0]
    if not tokens or len(tokens) != len(args.tokens.split(",")):
        p.error(f"--tokens takes positive integers, comma-separated, got {args.tokens!r}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the GPU's reads of host memory are what it measures); "
                "torch sees none")
    return args, shapes, tokens


def pinned_copy(src: torch.Tensor) -> torch.Tensor:
    """A cudaHostAlloc'd (torch pinned) copy of host tensor `src`."""
    return torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True).copy_(src)


def main(argv: list[str] | None = None) -> None:
    args, shapes, tokens = parse_args(argv)
    from hetmoe.engine.placement.stream_memory import pinned_groups

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report: dict[str, Any] = {"config": vars(args), "machine": machine_report(),
                              "device": torch.cuda.get_device_name(),
                              "pool_read_gb_s": round(_cpu.read_bandwidth(4 << 30, 5) / 1e9, 1)}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    size = int(args.gib * 2**30) // 2**20 * 2**20
    g = torch.Generator().manual_seed(0)
    host = pinned_copy(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    report["read"] = read_rows(host, shapes, sms, args.repeats)
    save()
    zero_copy = [r for r in report["read"] if r["source"] == "pinned_view" and "gb_s" in r]
    best = parse_shape(",".join(map(str, max(zero_copy, key=lambda r: r["gb_s"])["shape"])))
    view, dev = uint8_view(host), host.to("cuda")
    out = torch.empty(best.per_sm * sms, dtype=torch.int64, device="cuda")
    e, h, i, k = routed_expert_shape(args.shape)
    layers = int8_layers(args.cpu_layers, e, h, i)
    readers = {f"zero_copy {tuple(best)}": lambda: sum_bytes(view, best,
                                                                            out.numel(), out),
               "copy_h2d": lambda: dev.copy_(host, non_blocking=True)}
    report["overlap"] = {name: overlap(fn, size, layers, k, args.seconds)
                         for name, fn in readers.items()}
    save()
    (part,) = layers[0].packed_groups()
    keep = pinned_copy(host_tensor(part))
    sources = {"device": lambda: host_tensor(part).to("cuda"),
               "host_alloc": lambda: uint8_view(keep),
               "host_registered": lambda: uint8_view(pinned_groups(layers[0])[0])}
    report["pairs"] = pair_rows(layers[0], sources, tokens, k, args.calls, args.repeats)
    save()
    print_tables(report)


if __name__ == "__main__":
    main()
