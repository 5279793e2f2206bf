"""Streaming rate of the AVX-512 decode kernels alone, on many threads (no pool, no phases).

Compiles benchmarks/kernels/bench_decode_stream.cpp with g++ and the AVX-512 flags of CMakeLists.txt
against csrc/ (or, with --kernels DIR, also against DIR first: a tree holding another
kernels/avx512.cpp, e.g. `git archive OLD csrc | tar -x -C DIR`, to time two versions back to
back), then runs each format with one token against 1 GB of packed Qwen3-30B-A3B gate/up
matrices in the decode task shape, read once per pass, and a plain 8-byte read of the same
bytes. Builds alternate; prints GB/s (all threads) and GB/s per core (on-CPU time).

Usage: python benchmarks/kernels/bench_decode_stream.py [--kernels OLD_TREE] [--threads 15]
           [--gb 1.0] [--formats read,bf16,int8:64,int4:32] [--runs 1] [--json stream.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-O3 -std=c++20 -ffp-contract=off -fno-math-errno -mavx2 -mfma -mf16c -mavx512f "
         "-mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -pthread").split()


def build(include_first: Path | None, out: Path) -> Path:
    """The benchmark binary, compiled with `include_first` (if given) ahead of csrc/."""
    inc = ([f"-I{include_first}"] if include_first else []) + [f"-I{ROOT / 'csrc'}"]
    source = ROOT / "benchmarks" / "kernels" / "bench_decode_stream.cpp"
    cmd = ["g++", *FLAGS, *inc, str(source), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def run(binary: Path, fmt: str, group: int, threads: int, gb: float) -> dict:
    """One run's key=value fields (gbs, per_core_gbs, ...)."""
    out = subprocess.run([str(binary), fmt, str(group), str(threads), str(gb)], check=True,
                         capture_output=True, text=True).stdout
    return dict(kv.split("=") for kv in out.split())


def main() -> None:
    """Prints one line per (build, format, run)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, default=None,
                        help="tree with another kernels/avx512.cpp, timed against the current one")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--formats", default="read,bf16,int8:64,int4:32")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"current": build(None, Path(tmp) / "current")}
        if args.kernels:
            builds["other"] = build(args.kernels.resolve(), Path(tmp) / "other")
        for spec in args.formats.split(","):
            fmt, _, group = spec.partition(":")
            for _ in range(args.runs):
                for name, binary in builds.items():
                    f = run(binary, fmt, int(group or 0), args.threads, args.gb)
                    rows.append({"build": name, "format": spec, "threads": args.threads,
                                 "gbs": float(f["gbs"]),
                                 "per_core_gbs": float(f["per_core_gbs"])})
                    print(f"{name:8} {spec:8} {args.threads:3} threads: {f['gbs']:>6} GB/s, "
                          f"{f['per_core_gbs']} GB/s per core", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gb": args.gb, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
