"""Single-core AMX kernel throughput (kernels/amx.cpp alone), for tuning the prefill kernels.

Compiles benchmarks/kernels/bench_amx_core.cpp with g++ and the AMX flags of CMakeLists.txt against
csrc/ (or, with --kernels DIR, against DIR first: a tree holding another kernels/amx.cpp, to time
two versions back to back), then times the Qwen3-30B-A3B prefill task shapes with 128 rows per
expert: gate/up (K=2048, 32 n-blocks) and down (K=768, 16 n-blocks, rows 2048 floats apart).
Runs alternate between the builds; each prints on-CPU T(FL)OPS per core (median and best of
--runs). With --tiled, each build also runs with its activations handed over in tile order (as
the layer's prefill writes them; layout "tiled") beside row-major ones copied per call ("rows").
Needs a CPU with AMX and g++.

Usage: python benchmarks/kernels/bench_amx_core.py [--kernels OLD_TREE] [--runs 9] [--cpu 1]
           [--formats bf16,int8:64,int8:128] [--tiled] [--json amx_core.json]
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
         "-mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 "
         "-mamx-int8").split()
# name: (M, K, n-blocks, ldc floats)
SHAPES = {"gate_up": (128, 2048, 32, 512), "down": (128, 768, 16, 2048)}
COPIES = 64  # rotating packed copies: 64 x 2 MB (gate/up bf16) do not fit in L2/L3 slices


def build(include_first: Path | None, out: Path) -> Path:
    """The benchmark binary, compiled with `include_first` (if given) ahead of csrc/."""
    inc = ([f"-I{include_first}"] if include_first else []) + [f"-I{ROOT / 'csrc'}"]
    source = ROOT / "benchmarks" / "kernels" / "bench_amx_core.cpp"
    cmd = ["g++", *FLAGS, *inc, str(source), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def run(binary: Path, fmt: str, gs: int, shape: str, calls: int, cpu: int,
        tiled: bool = False) -> float:
    """T(FL)OPS per core of one run (activations in tile order when `tiled`)."""
    m, k, nblocks, ldc = SHAPES[shape]
    args = [fmt, m, k, nblocks, ldc, COPIES, calls, gs, cpu, int(tiled)]
    out = subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True,
                         text=True).stdout
    fields = dict(kv.split("=") for kv in out.split())
    return float(fields["tops_per_core"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, default=None,
                        help="tree with another kernels/amx.cpp, timed against the current one")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--cpu", type=int, default=1)
    parser.add_argument("--formats", default="bf16,int8:64,int8:128,int8:256")
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
        for spec in args.formats.split(","):
            fmt, _, gs = spec.partition(":")
            for shape in SHAPES:
                samples: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
                for _ in range(args.runs):
                    for (name, layout), binary in runs.items():
                        samples[name, layout].append(run(binary, fmt, int(gs or 64), shape,
                                                         args.calls, args.cpu,
                                                         layout == "tiled"))
                for (name, layout), vals in samples.items():
                    row = {"build": name, "layout": layout, "format": fmt,
                           "group_size": int(gs or 0), "shape": shape,
                           "median": statistics.median(vals), "best": max(vals)}
                    rows.append(row)
                    print(f"{name:8} {layout:5} {spec:9} {shape:8} T/core median "
                          f"{row['median']:.3f} best {row['best']:.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shapes": SHAPES, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
