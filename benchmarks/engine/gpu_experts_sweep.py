"""One command, both systems: the GPU expert budget swept for hetmoe and llama.cpp in one call.

Stages, in this order, each in its own process so one model's host memory is gone before the
next loads (all times under `--deadline`; a stage past its share is cut and the rest still runs):
1. `hetmoe`: bench_gpu_experts.py on Qwen3-30B-A3B (INT8, groups of 128) at every budget:
   decode per `--deferred`, prefill per `--prefill` length (engine's pick and the resident path).
2. `llamacpp`: the peer kit's prebuilt llama-bench (`--peer-dir`, .peers/README.md) on a
   random Qwen3-30B-A3B Q8_0 GGUF (make_gguf.py, same routing spread as ours), `-ngl 99 -ncmoe N`
   with N per budget from the Q8_0 expert bytes (hetmoe/bench/budget_peer.py): tg128 and
   pp4096 at each `--lcpp-ubatch` (the best kept), one model load per N.
3. `deepseek`: bench_gpu_experts.py on deepseek-v3-few-layers at `--deepseek-budgets` (decode).
4. `pp16k`: llama-bench pp16384 with `-ub 16384` per budget, if the deadline leaves time.
Then OUT/gpu_experts_sweep.{json,md,png}: both systems' decode and prefill against GB.

Formats: hetmoe INT8 = int8 weights with an fp32 scale per 128 (1.031 bytes per weight, the
default); llama.cpp Q8_0 = int8 with an fp16 scale per 32 (1.0625): hetmoe reads 3 % fewer
bytes per token; each system's GB on the GPU is its own.

    python benchmarks/engine/gpu_experts_sweep.py --peer-dir .peers --out OUT
    python benchmarks/engine/gpu_experts_sweep.py --report OUT   # tables + PNG again, no GPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hetmoe.bench import llama_kit
from hetmoe.bench.budget_peer import bench_args, by_budget, parse_budgets, parse_rows, peer_budgets
from hetmoe.bench.budget_report import MAIN_SHAPE, per_layer_table, plot, sweep_table
from hetmoe.config import EngineConfig

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-dir", type=Path, help="the llama.cpp peer kit (.peers)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", action="store_true", help="only write OUT's tables and PNG again")
    p.add_argument("--stages", default="hetmoe,llamacpp,deepseek,pp16k")
    p.add_argument("--budgets", default="0,8,15,23,all", help="GB of experts on the GPU, or all")
    p.add_argument("--deferred", default="0,3", help="hetmoe Expert Deferral values")
    p.add_argument("--defer-orders", default=EngineConfig.defer_order,
                   help="hetmoe deferral orders per d > 0 (misses, the engine's default; score; "
                        "or score,misses)")
    p.add_argument("--new-tokens", type=int, default=48, help="hetmoe decode tokens per run")
    p.add_argument("--prefill", default="4096,16384", help="hetmoe prefill lengths per budget")
    p.add_argument("--prefill-modes", default="auto")
    p.add_argument("--deepseek-budgets", default="0,8")
    p.add_argument("--threads", type=int, default=15, help="llama-bench -t (our pool: 15)")
    p.add_argument("--lcpp-ubatch", default="512,4096", help="pp4096 ubatches; the best is kept")
    p.add_argument("--lcpp-reps", type=int, default=2)
    p.add_argument("--gguf", type=Path, help="an existing Q8_0 GGUF (default: written here)")
    p.add_argument("--deadline", type=float, default=560, help="seconds for the whole sweep")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = set(args.stages) - {"hetmoe", "llamacpp", "deepseek", "pp16k"}
    if unknown:
        p.error(f"--stages: unknown {', '.join(sorted(unknown))} (hetmoe, llamacpp, deepseek, "
                "pp16k)")
    if not args.report and {"llamacpp", "pp16k"} & set(args.stages) and args.peer_dir is None:
        p.error("--peer-dir is needed for the llama.cpp stages (or --stages hetmoe,deepseek)")
    try:  # bad values end here, before any work
        parse_budgets(args.budgets)
        parse_budgets(args.deepseek_budgets)
        [int(u) for u in args.lcpp_ubatch.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    return args


def bench_hetmoe(args: argparse.Namespace, shape: str, budgets: str, extra: list[str],
                 timeout: float) -> tuple[str, Path]:
    out = args.out / f"hetmoe_{shape}.json"
    cmd = [sys.executable, str(HERE / "bench_gpu_experts.py"), "--shape", shape,
           "--weight-format", "int8", "--budgets", budgets, "--new-tokens",
           str(args.new_tokens), "--json", str(out), *extra]
    return llama_kit.run(cmd, args.out / f"hetmoe_{shape}.log", timeout), out


def setup_llama(args: argparse.Namespace, timeout: float) -> tuple[Path, dict[str, str], Path]:
    """The prebuilt llama-bench, its environment and the Q8_0 GGUF (written unless --gguf)."""
    work = args.out / "lcpp"
    bin_, env = llama_kit.unpack_llama_bench(args.peer_dir, work)
    if args.gguf is not None:
        return bin_, env, args.gguf
    return bin_, env, llama_kit.write_gguf(args.peer_dir, work, "q8_0", "q8_0",
                                           args.out / "gguf.log", timeout)


def llama_bench(bin_: Path, env: dict[str, str], args: argparse.Namespace, name: str,
                cli: list[str], timeout: float) -> tuple[str, list[dict[str, Any]]]:
    rows_file = args.out / f"lcpp_{name}.jsonl"
    status = llama_kit.run([str(bin_), *cli], args.out / f"lcpp_{name}.log", timeout, rows_file,
                           env)
    return status, parse_rows(rows_file.read_text()) if rows_file.exists() else []


def report(out: Path) -> dict[str, Any]:
    """OUT/gpu_experts_sweep.json -> its markdown tables (.md, printed) and PNG."""
    sweep = json.loads((out / "gpu_experts_sweep.json").read_text())
    parts = [f"Command: `{sweep['command']}` ({sweep['date']}, git {sweep['git']})", ""]
    if MAIN_SHAPE in sweep["hetmoe"]:
        parts += [sweep_table(sweep), ""]
        plot(sweep, str(out / "gpu_experts_sweep.png"))
    for shape, result in sweep["hetmoe"].items():
        if shape != MAIN_SHAPE:
            parts += [f"{shape}:", "", per_layer_table(result), ""]
    parts.append("Stage seconds: " + ", ".join(f"{k} {v[0]:.0f} ({v[1]})"
                                               for k, v in sweep["timings"].items()))
    text = "\n".join(parts)
    (out / "gpu_experts_sweep.md").write_text(text + "\n")
    print(text)
    return sweep


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(args.out)
        return
    from hetmoe.bench.harness import git_sha, now_utc

    end = time.monotonic() + args.deadline
    left = lambda reserve: end - time.monotonic() - reserve  # noqa: E731
    sweep: dict[str, Any] = {"command": " ".join(["benchmarks/engine/gpu_experts_sweep.py",
                                                  *(argv if argv is not None else sys.argv[1:])]),
                             "date": now_utc(), "git": git_sha(), "hetmoe": {}, "timings": {}}
    stages = args.stages

    def stage(name: str, work: Any) -> None:
        start = time.monotonic()
        try:
            status = work()
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            status = f"failed: {exc}"
        sweep["timings"][name] = (round(time.monotonic() - start, 1), status)
        print(f"== {name}: {status} in {sweep['timings'][name][0]} s", flush=True)
        (args.out / "gpu_experts_sweep.json").write_text(json.dumps(sweep, indent=1))

    def hetmoe(shape: str, budgets: str, extra: list[str], reserve: float) -> str:
        status, path = bench_hetmoe(args, shape, budgets, extra, left(reserve))
        if path.exists():
            sweep["hetmoe"][shape] = json.loads(path.read_text())
        return status

    # Reserves: what later stages need at least (seconds), so an early stage cannot eat them.
    later = {"llamacpp": 240, "deepseek": 100}
    if "hetmoe" in stages:
        stage("hetmoe", lambda: hetmoe(MAIN_SHAPE, args.budgets, [
            "--deferred", args.deferred, "--defer-orders", args.defer_orders,
            "--prefill", args.prefill, "--prefill-modes",
            args.prefill_modes], sum(later[s] for s in later if s in stages)))
    peers = peer_budgets(parse_budgets(args.budgets), MAIN_SHAPE)
    llama: dict[str, Any] = {}
    if {"llamacpp", "pp16k"} & set(stages):
        ubatches = [int(u) for u in args.lcpp_ubatch.split(",")]
        ncmoe = list(dict.fromkeys(p.ncmoe for p in peers))  # budgets may share an N
        sweep["llamacpp"] = {"format": "Q8_0", "threads": args.threads, "rows": [],
                             "ncmoe": {p.budget: p.ncmoe for p in peers}}

        def setup() -> str:
            llama["bin"], llama["env"], llama["gguf"] = setup_llama(args, min(180, left(160)))
            return "ok"

        def main_bench() -> str:
            cli = bench_args(str(llama["gguf"]), ncmoe, args.threads, 4096, 128, ubatches,
                             args.lcpp_reps)
            status, rows = llama_bench(llama["bin"], llama["env"], args, "main", cli,
                                       left(later["deepseek"] if "deepseek" in stages else 0))
            sweep["llamacpp"]["rows"] += rows
            sweep["llamacpp"]["budgets"] = by_budget(peers, sweep["llamacpp"]["rows"])
            return status

        stage("llamacpp_setup", setup)
        if "llamacpp" in stages and "bin" in llama:
            stage("llamacpp", main_bench)
    if "deepseek" in stages:
        stage("deepseek", lambda: hetmoe("deepseek-v3-few-layers", args.deepseek_budgets,
                                         ["--deferred", "0"], 0))
    if "pp16k" in stages and "bin" in llama and left(0) > 60:
        def pp16k() -> str:
            cli = bench_args(str(llama["gguf"]), ncmoe, args.threads, 16384, 0, [16384], 1)
            status, rows = llama_bench(llama["bin"], llama["env"], args, "pp16k", cli, left(5))
            sweep["llamacpp"]["rows"] += rows
            sweep["llamacpp"]["budgets"] = by_budget(peers, sweep["llamacpp"]["rows"])
            return status

        stage("pp16k", pp16k)
    if "gguf" in llama and args.gguf is None:
        Path(llama["gguf"]).unlink(missing_ok=True)  # 33 GB of tmpfs
    report(args.out)


if __name__ == "__main__":
    main()
