"""Decode with the step's kernels launched as programmatic dependents and without: one process per
run, variants alternating, one table.

Each round runs `bench_gpu_experts.py` once per variant in a fresh process (its own build of the
model and compile of the step) at the same budgets, and the table gives each budget's decode tok/s
per variant (mean of the rounds, every run in the JSON) and the ratio to `off`:

- `off`: HETMOE_DEPENDENT_LAUNCH=off, plain launches everywhere;
- `on`: the default, dependent launches where every expert is resident (kernels/pdl.py);
- `always`: also in steps with CPU experts (measured slower at budget 0 once);
- `kernels`: as `always` with Inductor's own kernels launched plainly;
- `inductor`: Inductor's kernels as dependents alone, ours plainly (`kernels` and `inductor`
  split a loss of `always` by who launches as a dependent).

    python benchmarks/engine/dependent_launch_ab.py --weight-format int8 --budgets 0,all \\
        --variants off,always,kernels,inductor --rounds 2 --json dependent_launch_ab.json

The arguments after `--` go to bench_gpu_experts.py as they are (e.g. `-- --profile`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).with_name("bench_gpu_experts.py")

PATCHES = {
    "kernels": "from hetmoe.engine.executor import fused_decode as f; "
               "f._inductor_options = lambda dependent: {}",
    "inductor": "from hetmoe.engine.executor import fused_decode as f; from hetmoe.kernels "
                "import pdl; f._inductor_options = lambda dependent: "
                "{'triton.enable_pdl': True}; f.FusedDecoder._dependent_launch = lambda self: "
                "self.kernels == 'triton'; pdl.enabled = lambda device: False",
}
"""Each split variant's patch, run before the benchmark in its process."""
SETTING = {"off": "off", "on": "on", "always": "always", "kernels": "always", "inductor": "on"}
"""HETMOE_DEPENDENT_LAUNCH of each variant."""


def command(variant: str, bench_args: list[str], out: Path,
            bench: Path = BENCH) -> tuple[list[str], dict[str, str]]:
    """The process of one run of `bench`: (argv, environment)."""
    if variant not in SETTING:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(SETTING)}")
    start = (f"import runpy, sys; sys.argv = [{str(bench)!r}] + sys.argv[1:]; "
             f"runpy.run_path({str(bench)!r}, run_name='__main__')")
    run = "; ".join(filter(None, (PATCHES.get(variant), start)))
    env = {**os.environ, "HETMOE_DEPENDENT_LAUNCH": SETTING[variant]}
    return [sys.executable, "-c", run, *bench_args, "--json", str(out)], env


def table(runs: dict[str, list[dict[str, Any]]]) -> tuple[str, list[dict[str, Any]]]:
    """Markdown table and its rows: per budget, each variant's mean decode tok/s over its runs
    and its ratio to `off` (where `off` ran)."""
    variants = list(runs)
    means: dict[str, dict[str, float]] = {}
    for variant, results in runs.items():
        by_budget: dict[str, list[float]] = {}
        for result in results:
            for row in result["rows"]:
                by_budget.setdefault(str(row["budget"]), []).append(row["tok_s"])
        means[variant] = {b: statistics.mean(v) for b, v in by_budget.items()}
    budgets = list(dict.fromkeys(b for m in means.values() for b in m))
    lines = ["| budget | " + " | ".join(f"{v} tok/s" for v in variants) + " | "
             + " | ".join(f"{v} / off" for v in variants if v != "off") + " |",
             "|---:|" + "---:|" * (2 * len(variants) - ("off" in variants))]
    rows = []
    for budget in budgets:
        row = {"budget": budget, **{v: means[v].get(budget) for v in variants}}
        base = means.get("off", {}).get(budget)
        ratios = [(means[v][budget] / base if base and budget in means[v] else None)
                  for v in variants if v != "off"]
        lines.append(f"| {budget} | " + " | ".join(
            "-" if row[v] is None else f"{row[v]:.1f}" for v in variants) + " | " + " | ".join(
            "-" if r is None else f"{r:.3f}x" for r in ratios) + " |")
        rows.append(row)
    return "\n".join(lines), rows


def run_all(variants: list[str], rounds: int, bench_args: list[str], folder: Path,
            run: Callable[..., Any] = subprocess.run) -> dict[str, list[dict[str, Any]]]:
    """Every round runs each variant once, in order -> each variant's results."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in variants:
            out = folder / f"{variant}_{r}.json"
            argv, env = command(variant, bench_args, out)
            done = run(argv, env=env)
            if done.returncode != 0 or not out.exists():
                raise RuntimeError(f"the {variant} run of round {r} failed "
                                   f"(exit {done.returncode}): see its output above")
            runs[variant].append(json.loads(out.read_text()))
    return runs


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weight-format", default="int8")
    p.add_argument("--budgets", default="0,all")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--variants", default="off,on,always")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in SETTING:  # named before any run
            p.error(f"unknown variant {variant!r}: one of {', '.join(SETTING)}")
    bench_args = ["--weight-format", args.weight_format, "--budgets", args.budgets,
                  "--deferred", "0", "--new-tokens", str(args.new_tokens), *bench_args]
    with tempfile.TemporaryDirectory() as folder:
        runs = run_all(variants, args.rounds, bench_args, Path(folder))
    text, rows = table(runs)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"variants": variants, "rounds": args.rounds, "bench_args": bench_args,
             "table": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
