"""CpuMoE speed at a real model's layer shape (default Qwen3-30B-A3B: E=128, H=2048, I=768,
top-8), BF16/INT8/INT4, and FP8 (e4m3 with 128x128 block scales, as DeepSeek-V3 stores experts).

Per format and q: the median time of one layer call (public `CpuMoE.forward`, layers cycled so
weights come from DRAM), weight bytes read / time against the read bandwidth measured in this run
(decode), TFLOPS (prefill), and a plain-torch per-expert loop on bf16 weights as the baseline.
First it measures the AVX-512/AMX crossover (tokens per expert) per format and uses it.

Usage: python benchmarks/kernels/bench_cpu_moe.py [--shape deepseek-v2-lite] [--layers 6]
           [--formats bf16,int8,int4 | --weight-format fp8] [--json out.json] [--quick]
           [--no-crossover] [--git SHA] [--warmup-s 1.0] [--trace DIR] [--int4-kernel bf16,i8]

--int4-kernel picks the AMX int4 kernel (HETMOE_AMX_INT4: bf16 tiles or int8 tiles, read once per
process): one name runs here; several run one child process each (the first every format, the
others the int4 formats only) and merge their rows into one JSON, each int4 row naming its kernel.

Each row also gives the phases of profiled calls: their wall times, and their busy shares (the
workers' summed task time over the phase's wall time x workers; below 1: workers wait, on the
phase's tail or its start), with --trace a Chrome trace of one such call per prefill row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from hetmoe import _cpu, _cpu_testing
from hetmoe.bench.shapes import SHAPES, routed_expert_shape
from hetmoe.bench.task_spans import PHASES, busy_shares, chrome_trace
from hetmoe.experts import CpuMoE
from hetmoe.experts.call_check import check_call
from hetmoe.machine import huge_page_bytes, machine_report, source_commit

FORMATS = ("bf16", "int8", "int4")
FP8_BLOCK = (128, 128)
CROSSOVER_M = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)


def timed(fn, calls: int, warmup: int) -> float:
    """Median seconds of `fn(i)` over `calls` runs after `warmup` runs."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def timed_alternating(fns: dict, calls: int, warmup: int, rounds: int = 4) -> dict[str, float]:
    """Median seconds of each `fns[name](i)` over `calls` runs, taken in `rounds` alternating
    blocks (each after `warmup` runs), so drifts of the machine hit every variant alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for i in range(warmup):
                fn(i)
            for i in range(max(1, calls // rounds)):
                start = time.perf_counter()
                fn(i)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


ROUTINGS = 16  # routings cycled per q, so decode touches different experts every call


def cycle(layers: list, x: torch.Tensor, routes: list[tuple[torch.Tensor, torch.Tensor]]):
    """Call i runs layer i % len(layers) with routing i % len(routes): weights come from DRAM."""
    return lambda i: layers[i % len(layers)].forward(x, *routes[i % len(routes)])


def raw_cycle(layers: list[CpuMoE], x: torch.Tensor,
              routes: list[tuple[torch.Tensor, torch.Tensor]]):
    """Like `cycle`, through the C++ layer directly: the pool and kernels without Python checks."""
    out = torch.empty_like(x)
    args = [check_call(layers[0].hidden, x, *r, out)[1] for r in routes]
    raw = [moe._layer for moe in layers]
    return lambda i, keep=(out, routes): raw[i % len(raw)].forward(*args[i % len(args)])


def with_setting(layers: list[CpuMoE], setter, value, fn):
    """`fn` (call i runs layer i % len(layers)) with `setter(that layer's _layer, value)` called
    first (e.g. _cpu_testing.set_decode_cols): one setting per timed call."""
    def run(i: int) -> None:
        setter(layers[i % len(layers)]._layer, value)
        fn(i)
    return run


def routing(q: int, num_experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct top-k ids [q, k] and softmax weights, like a router."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(q, num_experts, generator=g)
    top = scores.topk(k, dim=1)
    return top.indices.contiguous(), torch.softmax(top.values, 1).float().contiguous()


def same_experts(m: int, num_experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m tokens that all go to the same k random experts: m tokens per expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_experts, generator=g)[:k].repeat(m, 1)
    return ids.contiguous(), torch.full((m, k), 1.0 / k)


def torch_read_bandwidth(gib: float) -> float:
    """Bytes/s of torch summing a `gib` GiB float32 array (all torch threads), for comparison."""
    data = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32).uniform_()
    return data.numel() * 4 / timed(lambda i: data.sum(), 5, 1)


def matmul_tflops() -> float:
    """bf16 GEMM ceiling of this CPU through torch (oneDNN), 4096^3."""
    a = torch.randn(4096, 4096).bfloat16()
    b = torch.randn(4096, 4096).bfloat16()
    sec = timed(lambda i: a @ b, 5, 2)
    return 2 * 4096**3 / sec / 1e12


class TorchLayer:
    """The baseline: plain torch, a loop over experts with tokens, bf16 matmuls, index_add."""

    def __init__(self, weights: tuple[torch.Tensor, ...]) -> None:
        self.weights = weights

    def forward(self, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """out[q, H] in fp32."""
        gate, up, down = self.weights
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in ids[ids >= 0].unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xe = x[tok]  # [n, H]
            h = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
            out.index_add_(0, tok, (h @ down[e].T).float() * wts[tok, slot, None])
        return out


def crossover(layers: list[CpuMoE], quick: bool) -> tuple[int, list[dict]]:
    """Smallest tokens-per-expert m from which AMX beats AVX-512 on these layers (m tokens all
    on 8 random experts, new experts every call), switching the threshold between runs."""
    rows, best = [], None
    for m in CROSSOVER_M:
        x = torch.randn(m, layers[0].hidden).bfloat16()
        routes = [same_experts(m, layers[0].num_experts, 8, seed) for seed in range(ROUTINGS)]
        t = {}
        for isa, threshold in (("avx512", 1 << 30), ("amx", 1)):
            for moe in layers:
                moe.amx_min_tokens = threshold
            t[isa] = timed(cycle(layers, x, routes), 5 if quick else 40, len(layers))
        rows.append({"m": m, "avx512_us": t["avx512"] * 1e6, "amx_us": t["amx"] * 1e6})
        if best is None and t["amx"] < t["avx512"]:
            best = m
        elif best is not None and t["amx"] >= t["avx512"]:
            best = None  # not yet a stable win
    return (best or CROSSOVER_M[-1]), rows


def phases(layers: list[CpuMoE], x: torch.Tensor,
           routes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], float,
                                                                     list[float], list]:
    """Median microseconds per phase (convert, gather, gate/up, down, combine) over one profiled
    call per route (one call's phases vary by tens of percent), the median wall time of those
    calls in ms, the median busy share per phase (busy_shares) and the last call's task spans.
    Routes not used by the timed calls, so the weights come from DRAM."""
    samples, walls, shares, spans = [], [], [], []
    for i, route in enumerate(routes):
        moe = layers[i % len(layers)]
        try:
            _cpu_testing.set_profile(moe._layer, True, True)
        except TypeError:  # a build from before task spans, timed against this one
            _cpu_testing.set_profile(moe._layer, True)
        start = time.perf_counter()
        moe.forward(x, *route)
        walls.append(time.perf_counter() - start)
        _cpu_testing.set_profile(moe._layer, False)
        samples.append(_cpu_testing.phase_us(moe._layer))
        # (a build from before task spans, timed against this one, has none)
        spans = [list(s) for s in _cpu_testing.task_spans(moe._layer)]
        shares.append(busy_shares(spans))
    return ([round(statistics.median(s[p] for s in samples), 1) for p in range(len(samples[0]))],
            1e3 * statistics.median(walls),
            [round(statistics.median(s[p] for s in shares), 3) for p in range(len(PHASES))],
            spans)


def warm_up(layers: list[CpuMoE], seconds: float) -> None:
    """Decode calls for `seconds` right after packing: the first calls over freshly packed
    weights run slower (seen in round 3 as a q=1 time 25-35 us above its raw C++ time)."""
    x = torch.randn(1, layers[0].hidden).bfloat16()
    routes = [routing(1, layers[0].num_experts, 8, seed=r) for r in range(ROUTINGS)]
    call, end, i = cycle(layers, x, routes), time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        call(i)
        i += 1


def fp8_source(src: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The bf16 weights as an FP8 checkpoint stores them: e4m3 codes, then per 128x128 block
    scales amax / 448 (weight_scale_inv), [E, ceil(rows/128), ceil(cols/128)]."""
    codes, scales = [], []
    for w in src:  # [E, rows, cols]
        e, rows, cols = w.shape
        b0, b1 = FP8_BLOCK
        padded = torch.nn.functional.pad(w.float(), (0, -cols % b1, 0, -rows % b0))
        blocks = padded.unflatten(1, (-1, b0)).unflatten(3, (-1, b1))  # [E, R, b0, C, b1]
        scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
        quant = (blocks / scale[:, :, None, :, None]).flatten(3, 4).flatten(1, 2)
        codes.append(quant[:, :rows, :cols].to(torch.float8_e4m3fn).contiguous())
        scales.append(scale.contiguous())
    return (*codes, *scales)


def use_int4_kernel(name: str) -> None:
    """Run this process's AMX int4 rows on kernel `name` (set before the first layer reads it)."""
    os.environ["HETMOE_AMX_INT4"] = name
    if _cpu.amx_int4_kernel() != name:
        raise SystemExit(f"--int4-kernel {name}: this process already runs "
                         f"{_cpu.amx_int4_kernel()!r} (HETMOE_AMX_INT4 is read once)")


def ab_int4(kernels: list[str], specs: list[str], out: Path) -> None:
    """One child process per int4 kernel (this script, its arguments, then the kernel, its own
    JSON and, after the first, the int4 formats only), merged into `out`: the first child's
    report with every later child's rows appended and the kernels' ms per (q, k) side by side."""
    int4 = [spec for spec in specs if spec.partition(":")[0] == "int4"]
    if not int4:
        raise SystemExit(f"--int4-kernel {','.join(kernels)}: no int4 format among {specs}")
    report: dict = {}
    for i, kernel in enumerate(kernels):
        part = out.with_name(f"{out.stem}.{kernel}{out.suffix}")
        argv = [*sys.argv[1:], "--int4-kernel", kernel, "--json", str(part)]
        if i > 0:
            argv += ["--formats", ",".join(int4), "--weight-format", ""]
        subprocess.run([sys.executable, __file__, *argv], check=True)
        child = json.loads(part.read_text())
        if not report:
            report = child
        else:
            report["rows"] += [r for r in child["rows"] if "int4_kernel" in r]
    ab: dict[str, dict[str, float]] = {}
    for r in report["rows"]:
        if "int4_kernel" in r:
            ab.setdefault(f"{r['format']} q={r['q']} k={r['k']}", {})[r["int4_kernel"]] = r["ms"]
    report.pop("amx_int4_kernel")  # the first child's; each int4 row names its own
    report["int4_kernels"] = kernels
    report["int4_ab_ms"] = ab
    out.write_text(json.dumps(report, indent=1))
    print(f"\nint4 kernels, ms ({' / '.join(kernels)}):")
    for key, ms in ab.items():
        print(f"{key:24} " + " / ".join(f"{ms.get(k, float('nan')):.3f}" for k in kernels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                        help="the routed experts' shape (bench/shapes.py)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, help="routed experts (default: the shape's)")
    parser.add_argument("--q", default="1,2,4,8,32,128,512,2048")
    parser.add_argument("--json", type=Path, default=Path("bench_cpu_moe.json"))
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated FORMAT or FORMAT:GROUP_SIZE (e.g. int8:128)")
    parser.add_argument("--weight-format", default="",
                        help="one FORMAT or FORMAT:GROUP_SIZE, in place of --formats (fp8: "
                             "the weights as e4m3 with 128x128 block scales)")
    parser.add_argument("--quick", action="store_true", help="few calls (a smoke run)")
    parser.add_argument("--no-crossover", action="store_true",
                        help="skip the AVX-512/AMX crossover runs; use AMX_MIN_TOKENS")
    parser.add_argument("--warmup-s", type=float, default=1.0,
                        help="decode calls for this long after each format's layers are packed")
    parser.add_argument("--k", default="",
                        help="comma-separated experts per token (e.g. 8,3: a deferred job's 3; "
                             "default: the shape's)")
    parser.add_argument("--decode-cols", default="",
                        help="comma-separated decode gate/up task widths to time against each "
                             "other at q <= 4 (e.g. 64,32), alternating in this process")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the plain-torch baseline (it keeps a bf16 copy of every layer)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="folder for a Chrome trace of one profiled call per prefill row "
                             "(q >= 512): every task's worker, phase and time")
    parser.add_argument("--git", default="",
                        help="commit to record (default: this checkout's, where it is one)")
    parser.add_argument("--int4-kernel", default="",
                        help="comma-separated AMX int4 kernels, bf16 and/or i8 (default: "
                             "HETMOE_AMX_INT4's); several: one child process each, one JSON")
    args = parser.parse_args()
    kernels = [v for v in args.int4_kernel.split(",") if v]
    bad = [v for v in kernels if v not in ("bf16", "i8")]
    if bad:
        parser.error(f"--int4-kernel: {bad} not among bf16, i8")
    if len(kernels) > 1:
        ab_int4(kernels, (args.weight_format or args.formats).split(","), args.json)
        return
    if kernels:
        use_int4_kernel(kernels[0])
    E, H, I, top_k = routed_expert_shape(args.shape)
    E = args.experts or E
    ks = [int(v) for v in (args.k or str(top_k)).split(",")]
    widths = [int(v) for v in args.decode_cols.split(",") if v]
    qs = [int(v) for v in args.q.split(",")]
    threads = torch.get_num_threads()
    torch_bandwidth = torch_read_bandwidth(1.0 if args.quick else 4.0)  # before the pool spins
    probe_bytes = (1 if args.quick else 4) << 30
    pool_bandwidth = _cpu.read_bandwidth(probe_bytes, 5)
    # The bound is the fastest plain read seen in the run (the strictest denominator).
    bandwidth = max(pool_bandwidth, torch_bandwidth)
    tflops_torch = matmul_tflops()
    g = torch.Generator().manual_seed(0)
    src = tuple(torch.randn(E, *s, generator=g).div_(s[1] ** 0.5).bfloat16()
                for s in ((I, H), (I, H), (H, I)))
    report = {"machine": machine_report(), "threads_torch": threads,
              "read_bandwidth_gbs": pool_bandwidth / 1e9, "torch_sum_gbs": torch_bandwidth / 1e9,
              "torch_bf16_matmul_tflops": tflops_torch,
              "shape": {"name": args.shape, "E": E, "H": H, "I": I, "k": ks, "layers": args.layers},
              "git": args.git or source_commit(Path(__file__).resolve().parents[2]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "warmup_s": args.warmup_s, "crossover": {},
              "amx_int4_kernel": _cpu.amx_int4_kernel(), "rows": []}
    amx = _cpu.best_isa() == "amx"
    baseline = [] if args.no_torch else [tuple(t.clone() for t in src) for _ in range(args.layers)]
    for spec in (args.weight_format or args.formats).split(","):
        fmt, _, group = spec.partition(":")  # e.g. int8:128, an int format's group size
        layers = []
        weights = fp8_source(src) if fmt == "fp8" else src
        for _ in range(args.layers):
            moe = CpuMoE(E, H, I, fmt, group_size=int(group) if group else None)
            moe.load(*weights)
            layers.append(moe)
        del weights
        # Share of the packed weights on huge pages (the rest costs a TLB walk per 4 KiB read).
        packed = sum(moe.packed_bytes for moe in layers)
        report.setdefault("huge_page_share", {})[spec] = round(
            min(1.0, huge_page_bytes() / packed), 3)
        print(f"{spec}: {packed / 1e9:.1f} GB packed, "
              f"{100 * report['huge_page_share'][spec]:.0f} % on huge pages", flush=True)
        warm_up(layers, args.warmup_s)
        if amx and not args.no_crossover:
            m, rows = crossover(layers, args.quick)
            report["crossover"][fmt] = {"amx_min_tokens": m, "rows": rows}
            print(f"crossover {fmt}: AMX from {m} tokens/expert", flush=True)
            for moe in layers:
                moe.amx_min_tokens = m
        expert_bytes = layers[0].packed_bytes / E
        for q, K in [(q, k) for q in qs for k in ks]:
            x = torch.randn(q, H, generator=g).bfloat16()
            routes = [routing(q, E, K, seed=1000 * q + r) for r in range(ROUTINGS)]
            distinct = statistics.mean(ids.unique().numel() for ids, _ in routes)
            calls = 4 if args.quick else max(8, min(800, 4000 // q))
            fns = {"ms": cycle(layers, x, routes)}
            if q <= 8:  # the pool + kernels alone, without the Python argument checks
                fns["raw_ms"] = raw_cycle(layers, x, routes)
            default_cols = layers[0]._layer.decode_cols
            set_cols = _cpu_testing.set_decode_cols
            if q <= 4 and widths:  # every variant sets its width: the default ones too
                fns = {name: with_setting(layers, set_cols, default_cols, fn)
                       for name, fn in fns.items()}
                for width in widths:
                    fns[f"cols{width}_ms"] = with_setting(layers, set_cols, width,
                                                          cycle(layers, x, routes))
            sec_of = timed_alternating(fns, calls, len(layers))
            for moe in layers:
                _cpu_testing.set_decode_cols(moe._layer, default_cols)
            sec = sec_of["ms"]
            phase_us, profiled_ms, busy, spans = phases(
                layers, x, [routing(q, E, K, seed=1000 * q + 500 + r) for r in range(9)])
            if args.trace and q >= 512 and spans:
                args.trace.mkdir(parents=True, exist_ok=True)
                name = f"trace_{spec.replace(':', '_g')}_q{q}_k{K}.json"
                (args.trace / name).write_text(json.dumps(chrome_trace(spans)))
            flops = 3 * 2 * H * I * q * K
            row = {"format": spec, "group_size": layers[0].group_size, "q": q, "k": K,
                   "ms": sec * 1e3,
                   "experts_touched": distinct,
                   "weight_gb_s": distinct * expert_bytes / sec / 1e9,
                   "bw_fraction": distinct * expert_bytes / sec / bandwidth,
                   "bw_floor_ms": distinct * expert_bytes / bandwidth * 1e3,
                   "tflops": flops / sec / 1e12,
                   "phase_us": phase_us, "profiled_ms": profiled_ms, "phase_busy": busy}
            if fmt == "int4" and amx:
                row["int4_kernel"] = report["amx_int4_kernel"]
            if "raw_ms" in sec_of:
                row["raw_ms"] = 1e3 * sec_of["raw_ms"]
            for name in (n for n in sec_of if n.startswith("cols")):
                row[name] = 1e3 * sec_of[name]
            if fmt == "bf16" and baseline:
                plain = [TorchLayer(w) for w in baseline]
                tsec = timed(cycle(plain, x, routes), max(2, calls // 10), 1)
                row["torch_ms"] = tsec * 1e3
                row["speedup_vs_torch"] = tsec / sec
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        layers.clear()
        args.json.write_text(json.dumps(report, indent=1))  # after each format: a cut run keeps it
    # Probe again once the weights are freed: the host's bandwidth drifts during a run.
    end_bandwidth = _cpu.read_bandwidth(probe_bytes, 5)
    report["read_bandwidth_end_gbs"] = end_bandwidth / 1e9
    bandwidth = max(bandwidth, end_bandwidth)
    report["bound_gbs"] = bandwidth / 1e9
    for r in report["rows"]:
        r["bw_fraction"] = r["weight_gb_s"] * 1e9 / bandwidth
        r["bw_floor_ms"] = r["weight_gb_s"] * r["ms"] / (bandwidth / 1e9)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s (best of the pool's read at the start "
          f"and end and torch's sum), torch bf16 matmul "
          f"{tflops_torch:.1f} TFLOPS, {report['machine']['cpu']}")
    print(f"{'fmt':5} {'q':>5} {'k':>2} {'ms':>9} {'GB/s':>7} {'%BW':>5} {'floor ms':>9} "
          f"{'TFLOPS':>7} {'torch ms':>9} {'x torch':>7}  "
          "phases us (convert gather gate/up down combine)  busy % (same phases)")
    for r in report["rows"]:
        print(f"{r['format']:5} {r['q']:>5} {r['k']:>2} {r['ms']:>9.3f} {r['weight_gb_s']:>7.1f} "
              f"{100 * r['bw_fraction']:>5.1f} {r['bw_floor_ms']:>9.3f} {r['tflops']:>7.2f} "
              f"{r.get('torch_ms', float('nan')):>9.3f} {r.get('speedup_vs_torch', 0):>7.2f}  "
              f"{' '.join(f'{v:.0f}' for v in r['phase_us'])}  "
              f"{' '.join(f'{100 * v:.0f}' for v in r['phase_busy'])}  "
              + " ".join(f"{n[:-3]} {v:.3f}" for n, v in r.items()
                         if n.startswith("cols")))


if __name__ == "__main__":
    main()
