"""The AMX ceilings of this machine with every CPU busy: what a bare tile loop reaches.

Runs bench_amx_core's 2 x 2 tile loop (four tdpbf16ps / tdpbusd per step on four C tiles) on one
CPU alone, then on every allowed CPU at once, with its operands kept in tile registers, reloaded
each step from 4 KB (L1), and walked through 256 KB (L2). A prefill kernel must load its A or B
tiles from L2 (an expert's 128 rows of activations are 256-512 KB), so the all-CPU L2 loop is
the ceiling to quote its matrix phases against; the register loop is the tile unit's own.
Per-CPU rates are on-CPU time (CLOCK_THREAD_CPUTIME_ID). Prints a table and writes JSON.

Usage: python benchmarks/kernels/bench_amx_ceiling.py [--rounds 200] [--json amx_ceiling.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_amx_core import build  # noqa: E402

LOOPS = ("bf16-peak", "bf16-peak-l1", "bf16-peak-l2", "int8-peak", "int8-peak-l1",
         "int8-peak-l2")


def rates(binary: Path, loop: str, cpus: list[int], rounds: int) -> list[float]:
    """Per-CPU T(FL)OPS of `loop` run on every CPU of `cpus` at once."""
    procs = [subprocess.Popen([str(binary), loop, *map(str, (0, 0, 0, 0, 0, rounds, 0, cpu))],
                              stdout=subprocess.PIPE, text=True) for cpu in cpus]
    out = []
    for proc in procs:
        text, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"bench_amx_core {loop} failed (exit {proc.returncode})")
        out.append(float(dict(kv.split("=") for kv in text.split())["tops_per_core"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200,
                        help="64k-instruction rounds per run (about 0.5 ms each alone)")
    parser.add_argument("--json", type=Path, default=Path("amx_ceiling.json"))
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(None, Path(tmp) / "bench_amx_core")
        for loop in LOOPS:
            alone = rates(binary, loop, cpus[-1:], args.rounds)[0]
            every = rates(binary, loop, cpus, args.rounds)
            rows.append({"loop": loop, "alone": alone, "all_cpus": len(cpus),
                         "per_cpu_median": statistics.median(every), "per_cpu": every,
                         "total": sum(every)})
    print(f"{'loop':<14} {'1 CPU':>7} {f'{len(cpus)} CPUs: median':>18} {'total':>8}  "
          "(TFLOPS bf16 / TOPS int8)")
    for r in rows:
        print(f"{r['loop']:<14} {r['alone']:>7.2f} {r['per_cpu_median']:>18.3f} "
              f"{r['total']:>8.2f}")
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                     "cpus": cpus, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
