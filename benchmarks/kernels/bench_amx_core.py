"""Single-core AMX kernel throughput (kernels/amx.cpp alone), for tuning the prefill kernels.

Compiles benchmarks/kernels/bench_amx_core.cpp with g++ and the AMX flags of CMakeLists.txt against
csrc/ (or, with --kernels DIR, against DIR first: a tree holding another kernels/amx.cpp, to time
two versions back to back), then times the Qwen3-30B-A3B prefill task shapes with 128 rows per
expert: gate/up (K=2048, 32 n-blocks) and down (K=768, 16 n-blocks, rows 2048 floats apart).
Runs alternate between the builds; each prints on-CPU T(FL)OPS per core (median and best of
--runs). With --tiled, each build also runs with its activations handed over in tile order (as
the layer's prefill writes them; layout "tiled") beside row-major ones copied per call ("rows").
Needs a CPU with AMX and g++.

With several --m, each shape also gets a least-squares line, microseconds per call = fixed +
per-row x m: the fixed part is what a call costs whatever its rows (the int4 kernels' widening
of every weight to bf16 or int8 tiles, the weights' read), the per-row part the tile work.
Formats: bf16, int8:GROUP, int4:GROUP (bf16 tiles), int4i8:GROUP (int8 tiles).

Usage: python benchmarks/kernels/bench_amx_core.py [--kernels OLD_TREE] [--runs 9] [--cpu 1]
           [--formats bf16,int8:64,int8:128,int4:32,int4i8:32] [--m 16,32,64,128]
           [--shapes gate_up,down] [--tiled] [--json amx_core.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-O3 -std=c++17 -ffp-contract=off -fno-math-errno -mavx2 -mfma -mf16c -mavx512f "
         "-mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mavx512vbmi -mamx-tile "
         "-mamx-bf16 -mamx-int8").split()
# name: (M, K, n-blocks, ldc floats)
SHAPES = {"gate_up": (128, 2048, 32, 512), "down": (128, 768, 16, 2048)}
COPIES = 64  # rotating packed copies: 64 x 2 MB (gate/up bf16) do not fit in L2/L3 slices


def build(include_first: Path | None, out: Path) -> Path:
    """The benchmark binary, compiled with `include_first` (if given) ahead of csrc/; the int4
    kernels, own translation units, from the first tree that has them."""
    inc = ([f"-I{include_first}"] if include_first else []) + [f"-I{ROOT / 'csrc'}"]
    source = ROOT / "benchmarks" / "kernels" / "bench_amx_core.cpp"
    units = []
    for name in ("amx_int4.cpp", "amx_int4_i8.cpp"):
        trees = ([include_first] if include_first else []) + [ROOT / "csrc"]
        units.append(next(str(t / "kernels" / name) for t in trees
                          if (t / "kernels" / name).exists()))
    cmd = ["g++", *FLAGS, *inc, str(source), *units, "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def run(binary: Path, fmt: str, gs: int, shape: str, calls: int, cpu: int,
        tiled: bool = False, m: int | None = None) -> dict[str, float]:
    """T(FL)OPS per core and microseconds per call of one run (activations in tile order when
    `tiled`; `m` rows instead of the shape's 128)."""
    rows, k, nblocks, ldc = SHAPES[shape]
    m = m or rows
    args = [fmt, m, k, nblocks, ldc, COPIES, calls, gs, cpu, int(tiled)]
    out = subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True,
                         text=True).stdout
    fields = dict(kv.split("=") for kv in out.split())
    return {"tops": float(fields["tops_per_core"]), "us": float(fields["us_per_call"])}


def per_row_fits(rows: list[dict]) -> list[dict]:
    """Per (build, layout, format, shape): the least-squares line us = fixed + row * m over its
    rows' medians (fixed: what a call costs whatever its rows, e.g. the weights' widening)."""
    names = ("build", "layout", "format", "group_size", "shape")
    keys = {tuple(r[n] for n in names) for r in rows}
    fits = []
    for key in sorted(keys):
        pts = [(r["m"], r["us_median"]) for r in rows if tuple(r[n] for n in names) == key]
        slope, fixed = statistics.linear_regression([m for m, _ in pts], [t for _, t in pts])
        first = min(pts)
        fits.append(dict(zip(names, key, strict=True),
                         fixed_us=fixed, row_us=slope, fixed_share_first_m=fixed / first[1]))
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, default=None,
                        help="tree with another kernels/amx.cpp, timed against the current one")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--formats", default="bf16,int8:64,int8:128,int8:256")
    parser.add_argument("--m", default="128",
                        help="rows per call, comma-separated (a prefill expert's tokens: 32 at "
                             "512 tokens over 128 experts of top-8); several give each shape's "
                             "per-call fixed part and per-row cost from a least-squares line")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tiled", action="store_true",
                        help="also time activations already in tile order (read in place)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"current": build(None, Path(tmp) / "current")}
        if args.kernels:
            builds["other"] = build(args.kernels.resolve(), Path(tmp) / "other")
        runs = {(name, layout): binary for name, binary in builds.items()
                for layout in (("rows", "tiled") if args.tiled else ("rows",))}
        rows = []
        ms = [int(m) for m in args.m.split(",")]
        for spec in args.formats.split(","):
            fmt, _, gs = spec.partition(":")
            for shape in args.shapes.split(","):
                for m in ms:
                    samples: dict[tuple[str, str], list[dict]] = {key: [] for key in runs}
                    for _ in range(args.runs):
                        for (name, layout), binary in runs.items():
                            samples[name, layout].append(run(
                                binary, fmt, int(gs or 64), shape, args.calls, args.cpu,
                                layout == "tiled", m))
                    for (name, layout), vals in samples.items():
                        tops = [v["tops"] for v in vals]
                        row = {"build": name, "layout": layout, "format": fmt,
                               "group_size": int(gs or 0), "shape": shape, "m": m,
                               "median": statistics.median(tops), "best": max(tops),
                               "us_median": statistics.median(v["us"] for v in vals)}
                        rows.append(row)
                        print(f"{name:8} {layout:5} {spec:9} {shape:8} m {m:4} T/core median "
                              f"{row['median']:.3f} best {row['best']:.3f} us/call "
                              f"{row['us_median']:.1f}", flush=True)
        fits = per_row_fits(rows) if len(ms) > 1 else []
        for f in fits:
            print(f"{f['build']:8} {f['layout']:5} {f['format']}:{f['group_size']} {f['shape']:8} "
                  f"fixed {f['fixed_us']:.1f} us + {f['row_us']:.3f} us/row "
                  f"(fixed share at m {ms[0]}: {f['fixed_share_first_m']:.0%})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shapes": SHAPES, "rows": rows, "fits": fits},
                                        indent=1))


if __name__ == "__main__":
    main()
