"""One call, both CPU MoE kernels: hetmoe's `CpuMoE` against kt-kernel's AMX MoE, side by side.

In one process: (1) the peer kit's `ktk_bench.py` (`--peer-dir`, .peers/README.md) in a subprocess
before our pool exists, with our THREADS / QLENS / SHAPE / LAYERS and SKIP_TORCH=1; (2) the read
bandwidth (bench_cpu_moe's probes: torch's sum, the pool's read, again at the end: the best); (3)
our layer per format at every q; then a table, OUT/cpu_moe_vs_kt.json and .png (kt ms / our ms).
OUT holds only these and kt's ktk_bench.json and stdout (ktk_stdout.log): kt writes into `--work`
(default a temp dir, removed at the end), so a device call's few returned files hold them all.

What ktk_bench.py times, and how ours matches it:
- Shape E, H, I, top-k (default Qwen3-30B-A3B: 128, 2048, 768, 8); `--layers` (6) packed
  copies cycled, call i on layer i % layers, each layer with its own x and routing, so weights
  come from DRAM. kt packs 6 different weight sets; ours packs one set 6 times (same bytes read).
- Routing: each token's k distinct experts uniform at random (kt: randperm; ours:
  bench_cpu_moe.routing, the top-k of Gaussian scores, the same distribution), weights summing
  to 1 (kt: normalized uniforms; ours: softmax of the scores). Not the same draws.
- Weights N(0, 0.02^2) and x N(0, 1) in bf16 on both sides (kt's distributions, our seeds).
- Threads: `--threads` (15) pool workers on both sides plus the calling thread (the kit's
  README: 16 starves its driving thread). Outputs bf16 into buffers kept across calls.
- Per q: one untimed pass over the layers; latency: the median of `reps` calls, each waited for;
  `ms` (the ratio's figure, kt's JSON `ms`): `reps` calls queued back to back, waited for once,
  over reps (no wake-up per call). reps = max(12, 4 layers) at q <= 128, else max(6, layers).
  Ours submits through `CpuMoE.submit` (its Python checks included); kt's latency comes from its
  stdout ("per-call submit+sync latency"), its JSON has only the batch figure.
- Error: ||out - ref|| / ||ref|| of one call (layer 0's) in bf16, ref from the unquantized bf16
  weights (kt: in fp32; ours: in float64).
- T(FL)OPS: 6 H I k q / ms, both sides. % of the bandwidth floor (ours, q <= 32): the packed
  bytes the calls touch (scales included; mean over the layers) at the best read rate, over ms.
Differences kept: the formats are each side's own (ours: int8 with an fp32 scale per group of
128, int4 asymmetric per group of 32, or FORMAT:GROUP; kt quantizes the bf16 weights itself at
load, its own way: compare the error columns); ours uses `AMX_MIN_TOKENS` (AVX-512 below it);
`--warmup-s` (default 0, as kt) adds decode calls after our packing.

    python benchmarks/peers/cpu_moe_vs_kt.py --peer-dir .peers --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe import _cpu
from hetmoe.experts import CpuMoE
from hetmoe.machine import machine_report, source_commit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import bench_cpu_moe as cpu_bench  # noqa: E402  (the sibling folder's script: its probes)

FORMATS = ("bf16", "int8", "int4")
KT_METHODS = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE"}
SMALL_Q = 32
"""Up to this q the table gives % of the bandwidth floor, above it T(FL)OPS."""
WEIGHT_STD = 0.02
KT_ROW = re.compile(r"^kt-(\S+)\s+q=\s*(\d+)\s")
KT_LATENCY = re.compile(r"per-call submit\+sync latency ([0-9.]+) ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every value checked here, before any slow work."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-dir", type=Path, default=Path(".peers"),
                   help="the peer kit (a copy of ../shared/peers): its ktk_bench.py and ktk/")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for the JSON, PNG, kt's JSON and its log (nothing else)")
    p.add_argument("--work", type=Path, help="kt's own output folder (default: a temp dir)")
    p.add_argument("--formats", default=",".join(FORMATS), help="FORMAT or FORMAT:GROUP_SIZE")
    p.add_argument("--q", default="1,2,8,32,128,512,2048", help="tokens per call")
    p.add_argument("--shape", default="128,2048,768,8", help="E,H,I,K (experts, hidden, "
                   "expert width, experts per token); default Qwen3-30B-A3B's")
    p.add_argument("--layers", type=int, default=6, help="packed layers cycled (kt's LAYERS)")
    p.add_argument("--threads", type=int, default=15, help="pool workers, both sides")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="our decode calls after packing each format (kt has none)")
    p.add_argument("--bandwidth-gib", type=float, default=4.0, help="read probe size")
    p.add_argument("--kt-timeout", type=float, default=400.0, help="seconds for ktk_bench.py")
    args = p.parse_args(argv)
    try:
        args.qs = positive_ints(args.q, "--q")
        args.shape_ = positive_ints(args.shape, "--shape")
    except ValueError as exc:
        p.error(str(exc))
    if len(args.shape_) != 4 or args.shape_[3] > args.shape_[0]:
        p.error(f"--shape takes E,H,I,K with K <= E, got {args.shape!r}")
    args.specs = []
    for spec in args.formats.split(","):
        fmt, _, group = spec.partition(":")
        if fmt not in FORMATS or (group and (not group.isdigit() or fmt == "bf16")):
            p.error(f"--formats takes {', '.join(FORMATS)} (int8/int4 with :GROUP_SIZE), "
                    f"got {spec!r}")
        args.specs.append((spec, fmt, int(group) if group else None))
    for name in ("layers", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("bandwidth_gib", "kt_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.warmup_s < 0:
        p.error(f"--warmup-s must be >= 0, got {args.warmup_s}")
    if not (args.peer_dir / "ktk_bench.py").is_file():
        p.error(f"--peer-dir {args.peer_dir}: no ktk_bench.py there (copy the peer kit first: "
                "cp -r ../shared/peers .peers, and carry .peers to the device)")
    return args


def positive_ints(text: str, flag: str) -> list[int]:
    """'1,2,8' -> [1, 2, 8]; a value that is not a positive integer, or twice, is an error."""
    values = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"{flag} takes positive integers, got {part!r} in {text!r}")
        values.append(int(part))
    if len(set(values)) != len(values):
        raise ValueError(f"{flag} lists a value twice: {text!r}")
    return values


def run_kt(args: argparse.Namespace, folder: Path) -> dict[tuple[str, int], dict[str, float]]:
    """ktk_bench.py in a subprocess with our settings, writing into `folder`; its rows by
    (format, q), each with the latency its stdout printed. Its stdout and JSON land in OUT."""
    folder.mkdir(parents=True, exist_ok=True)
    formats = list(dict.fromkeys(fmt for _, fmt, _ in args.specs))
    env = dict(os.environ, THREADS=str(args.threads), QLENS=",".join(map(str, args.qs)),
               SHAPE=",".join(map(str, args.shape_)), LAYERS=str(args.layers),
               METHODS=",".join(KT_METHODS[f] for f in formats), SKIP_TORCH="1",
               OUT=str(folder), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(args.peer_dir / "ktk_bench.py")]
    print(f"+ {' '.join(cmd)}  ({args.kt_timeout:.0f} s)", flush=True)
    log = args.out / "ktk_stdout.log"
    try:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=args.kt_timeout)
        text, status = done.stdout, ("ok" if done.returncode == 0 else f"exit {done.returncode}")
    except subprocess.TimeoutExpired as exc:  # its output is bytes even with text=True
        out = exc.output
        text = out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
        status = f"timed out after {args.kt_timeout:.0f} s"
    log.write_text(text)
    if status != "ok":
        tail = "\n".join(text.splitlines()[-15:])
        raise SystemExit(f"ktk_bench.py: {status} (log {log}); its last lines:\n{tail}")
    print(text, end="", flush=True)
    kt_json = shutil.copy(folder / "ktk_bench.json", args.out / "ktk_bench.json")
    rows = kt_rows(json.loads(Path(kt_json).read_text()), text)
    missing = [f"{KT_METHODS[f]} q={q}" for f in formats for q in args.qs if (f, q) not in rows]
    if missing:  # before our slow part
        raise SystemExit(f"{kt_json} lacks rows: {', '.join(missing)}")
    return rows


def kt_rows(result: dict[str, Any], stdout: str) -> dict[tuple[str, int], dict[str, float]]:
    """ktk_bench.json's kt rows by (our format name, q), with `latency_ms` from the stdout line
    that precedes each row's line."""
    names = {method.replace("_MOE", ""): fmt for fmt, method in KT_METHODS.items()}
    latency: dict[tuple[str, int], float] = {}
    pending = None
    for line in stdout.splitlines():
        if found := KT_LATENCY.search(line):
            pending = float(found.group(1))
        elif (row := KT_ROW.match(line)) and pending is not None:
            latency[(row.group(1), int(row.group(2)))] = pending
            pending = None
    rows = {}
    for r in result["rows"]:
        if not r["impl"].startswith("kt-"):
            continue
        name = r["impl"][3:]
        if (name, r["qlen"]) not in latency:
            raise ValueError(f"ktk_bench.py: no latency line before its {r['impl']} q="
                             f"{r['qlen']} row in its stdout")
        rows[(names[name], r["qlen"])] = {
            "ms": r["ms"], "latency_ms": latency[(name, r["qlen"])], "tflops": r["tflops"],
            "rel_err": r["rel_err"], "frac_stream": r["frac_stream"]}
    return rows


def reference(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
              src: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float64 sum_j w_j * down_e(silu(gate_e x) * up_e x) on the unquantized weights, [q, H]."""
    gate, up, down = src
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].double()  # [n, H]
        h = torch.nn.functional.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out.index_add_(0, tok, (h @ down[e].double().T) * wts[tok, slot, None].double())
    return out


def calls_for(q: int, args: argparse.Namespace) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: x [q, H] bf16, ids [q, K], weights [q, K], out [q, H] (kept, as kt keeps
    its y: no allocation per call); the same for every format."""
    E, H, _, K = args.shape_
    g = torch.Generator().manual_seed(q)
    return [(torch.randn(q, H, generator=g).bfloat16(),
             *cpu_bench.routing(q, E, K, seed=1000 * q + layer),
             torch.empty(q, H, dtype=torch.bfloat16)) for layer in range(args.layers)]


def time_calls(layers: list, calls: list[tuple[torch.Tensor, ...]]) -> tuple[float, float]:
    """(seconds per call of a back-to-back batch, median seconds of a waited call), ktk_bench's
    way: one untimed pass, then reps calls each, call i on layer i % len(layers)."""
    n = len(layers)
    reps = max(12, 4 * n) if calls[0][0].shape[0] <= 128 else max(6, n)
    for layer, call in zip(layers, calls, strict=True):
        layer.forward(*call)
    waited = []
    for i in range(reps):
        start = time.perf_counter()
        layers[i % n].forward(*calls[i % n])
        waited.append(time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(reps):
        layers[i % n].submit(*calls[i % n])
    for i in range(reps):
        layers[i % n].sync()
    return (time.perf_counter() - start) / reps, statistics.median(waited)


def run_format(spec: str, fmt: str, group: int | None, src: tuple[torch.Tensor, ...],
               args: argparse.Namespace, refs: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
    """Our rows of one format: packs `--layers` copies, then times every q."""
    E, H, I, K = args.shape_
    layers = []
    for _ in range(args.layers):
        layers.append(CpuMoE(E, H, I, fmt, group_size=group, threads=args.threads))
        layers[-1].load(*src)
    expert_bytes = layers[0].packed_bytes / E
    if args.warmup_s:
        calls, end, i = calls_for(1, args), time.perf_counter() + args.warmup_s, 0
        while time.perf_counter() < end:
            layers[i % len(layers)].forward(*calls[i % len(calls)])
            i += 1
    rows = []
    for q in args.qs:
        calls = calls_for(q, args)
        sec, latency = time_calls(layers, calls)
        x, ids, wts, _ = calls[0]
        if q not in refs:
            refs[q] = reference(x, ids, wts, src)
        err = float((layers[0].forward(x, ids, wts).double() - refs[q]).norm() / refs[q].norm())
        touched = statistics.mean(c[1].unique().numel() for c in calls)
        rows.append({"format": spec, "group_size": layers[0].group_size, "q": q,
                     "ms": sec * 1e3, "latency_ms": latency * 1e3, "rel_err": err,
                     "tflops": 6 * H * I * K * q / sec / 1e12, "experts_touched": touched,
                     "touched_bytes": touched * expert_bytes})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def combine(ours: list[dict[str, Any]], kt: dict[tuple[str, int], dict[str, float]],
            bandwidth_gbs: float) -> list[dict[str, Any]]:
    """Our rows with kt's beside them, the ratios (kt / ours: above 1 ours is faster) and our
    bandwidth floor (touched bytes / bandwidth) and share of it."""
    rows = []
    for r in ours:
        fmt = r["format"].partition(":")[0]
        if (fmt, r["q"]) not in kt:
            raise ValueError(f"ktk_bench.json has no {KT_METHODS[fmt]} row at q={r['q']}")
        peer = kt[(fmt, r["q"])]
        floor_ms = r["touched_bytes"] / (bandwidth_gbs * 1e9) * 1e3
        rows.append({**r, "bw_floor_ms": floor_ms, "bw_fraction": floor_ms / r["ms"],
                     **{f"kt_{k}": v for k, v in peer.items()},
                     "ratio": peer["ms"] / r["ms"],
                     "latency_ratio": peer["latency_ms"] / r["latency_ms"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (format, q): ms both sides (batch, waited), ratios, errors, our rate."""
    lines = [f"{'format':8} {'q':>5} {'ours ms':>9} {'kt ms':>9} {'kt/ours':>7} "
             f"{'ours lat':>9} {'kt lat':>9} {'kt/ours':>7} {'ours err':>8} {'kt err':>8}  ours"]
    for r in rows:
        rate = (f"{100 * r['bw_fraction']:.1f} % of BW floor ({r['bw_floor_ms']:.3f} ms)"
                if r["q"] <= SMALL_Q else
                f"{r['tflops']:.2f} {'TFLOPS' if r['format'] == 'bf16' else 'TOPS'}")
        lines.append(f"{r['format']:8} {r['q']:>5} {r['ms']:>9.3f} {r['kt_ms']:>9.3f} "
                     f"{r['ratio']:>7.2f} {r['latency_ms']:>9.3f} {r['kt_latency_ms']:>9.3f} "
                     f"{r['latency_ratio']:>7.2f} {r['rel_err']:>8.4f} {r['kt_rel_err']:>8.4f}"
                     f"  {rate}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """kt ms / our ms against q per format: batch (solid) and waited calls (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == spec]
        line, = ax.plot([r["q"] for r in mine], [r["ratio"] for r in mine], "o-", label=spec)
        ax.plot([r["q"] for r in mine], [r["latency_ratio"] for r in mine], "x--",
                color=line.get_color(), label=f"{spec}, waited calls")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    qs = sorted({r["q"] for r in rows})
    ax.set_xticks(qs, [str(q) for q in qs])
    ax.set_xlabel("tokens per call (q)")
    ax.set_ylabel("kt-kernel ms / hetmoe ms (above 1: hetmoe faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ktk_bench_") as temp:  # unused with --work
        kt = run_kt(args, args.work or Path(temp))
    probe = int(args.bandwidth_gib * 2**30)
    start_bw = [cpu_bench.torch_read_bandwidth(args.bandwidth_gib),
                _cpu.read_bandwidth(probe, 5, args.threads)]
    E, H, I, _ = args.shape_
    g = torch.Generator().manual_seed(0)
    src = tuple((torch.randn(E, *s, generator=g) * WEIGHT_STD).bfloat16()
                for s in ((I, H), (I, H), (H, I)))
    refs: dict[int, torch.Tensor] = {}
    ours = [row for spec, fmt, group in args.specs
            for row in run_format(spec, fmt, group, src, args, refs)]
    end_bw = _cpu.read_bandwidth(probe, 5, args.threads)
    bandwidth = max(*start_bw, end_bw) / 1e9  # the strictest floor: the best read seen
    rows = combine(ours, kt, bandwidth)
    root = Path(__file__).resolve().parents[2]
    report = {"machine": machine_report(), "git": source_commit(root),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": {"shape": args.shape_, "layers": args.layers, "threads": args.threads,
                         "q": args.qs, "formats": [s for s, _, _ in args.specs],
                         "warmup_s": args.warmup_s},
              "bandwidth_gbs": {"torch_sum": start_bw[0] / 1e9, "pool_start": start_bw[1] / 1e9,
                                "pool_end": end_bw / 1e9, "bound": bandwidth},
              "rows": rows}
    (args.out / "cpu_moe_vs_kt.json").write_text(json.dumps(report, indent=1))
    title = (f"CPU MoE, E,H,I,K = {args.shape}, {args.threads} threads, "
             f"{report['machine'].get('cpu', '')}")
    plot(rows, args.out / "cpu_moe_vs_kt.png", title)
    print(f"\nread bandwidth {bandwidth:.1f} GB/s; ms = a batch of queued calls per call, "
          f"lat = one waited call (median); kt/ours above 1: hetmoe faster\n{table(rows)}")


if __name__ == "__main__":
    main()
