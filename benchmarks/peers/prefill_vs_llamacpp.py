"""Prefill tok/s per prompt length, hetmoe against llama.cpp, one device call (issue 31's figure).

Per `--formats` (int4 against Q4_0, int8 against Q8_0; one format per call fits the 600 s limit
best), in this order, each in its own process so one model's host memory is gone before the next:
1. ours: bench_prefill.py `--modes auto` on the Qwen3-30B-A3B shape with every expert in host
   memory, per `--lengths`: the engine's pick, the PCIe floor (packed expert bytes per pass over
   the H2D bandwidth measured in that process) and the GPU's expert compute per pass with every
   expert resident (the resident-compute line), plus the whole pass resident (`--resident-pass`);
2. llama.cpp: the peer kit's GGUF (`make_gguf.py --type q4_0|q8_0 --dense-type q8_0`) and its
   prebuilt llama-bench, experts in host memory (`-ngl 99 -ncmoe 48`), each length at the
   default ubatch and at `-ub` = the length (up to 16384): both kept, the best marked.
OUT/prefill_vs_llamacpp.json is rewritten after every point (a call cut by its limit keeps what
finished); then OUT/prefill_vs_llamacpp.{md,png}. OUT holds only these and one tar of the logs
and raw rows (prefill_vs_llamacpp_logs.tgz, rewritten after each stage): the llama.cpp kit, our
run's folder and the logs live in `--work` (default a temp dir, removed at the end) and the GGUF
in /dev/shm, so a device call's few returned files hold the whole result. `--plot-only` merges
the JSON of several calls into one table and one PNG (no GPU); `--from-log` does the same from
the tables that calls printed into their logs (for a call whose JSON was lost).

    python benchmarks/peers/prefill_vs_llamacpp.py --peer-dir .peers --formats int4 --out OUT
    python benchmarks/peers/prefill_vs_llamacpp.py --plot-only A.json B.json --out OUT
    python benchmarks/peers/prefill_vs_llamacpp.py --from-log int4.log int8.log --out OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetmoe.bench import llama_kit
from hetmoe.bench.budget_peer import bench_args, moe_layer_count, parse_rows
from hetmoe.bench.prefill_peer import (
    DENSE_TYPE,
    PEER_TYPES,
    merge,
    parse_formats,
    parse_lengths,
    parse_log,
    plot,
    table,
    ubatches,
)

PREFILL_SCRIPT = Path(__file__).resolve().parents[1] / "engine" / "bench_prefill.py"
SHAPE = "qwen3-30b-a3b"
"""The shape of both sides (the kit's GGUF is Qwen3-30B-A3B)."""
STAGE_MIN_S = {"ours": 120.0, "llamacpp": 150.0}
"""Seconds a later stage needs at least: an earlier one is cut to leave them."""
NAME = "prefill_vs_llamacpp"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True,
                   help="the JSON, md, PNG and one tar of logs (nothing else)")
    p.add_argument("--work", type=Path,
                   help="the kit, our run's folder and the logs (default: a temp dir, removed)")
    p.add_argument("--peer-dir", type=Path, help="the peer kit (.peers: llama-bench, make_gguf)")
    p.add_argument("--formats", default="int4,int8", help="int4 (vs Q4_0), int8 (vs Q8_0)")
    p.add_argument("--lengths", default="512,1024,4096,16384", help="prompt tokens")
    p.add_argument("--stages", default="ours,llamacpp", help="ours, llamacpp or both")
    p.add_argument("--deadline", type=float, default=540, help="seconds for the whole call")
    p.add_argument("--repeats", type=int, default=2, help="our timed passes per length (best)")
    p.add_argument("--resident-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="also time our whole pass with every expert resident on the GPU")
    p.add_argument("--threads", type=int, default=15, help="llama-bench -t (our pool: 15)")
    p.add_argument("--lcpp-reps", type=int, default=1, help="llama-bench -r")
    p.add_argument("--plot-only", type=Path, nargs="+", metavar="JSON",
                   help="merge these calls' JSON into one table and PNG under --out; no runs")
    p.add_argument("--from-log", type=Path, nargs="+", metavar="LOG",
                   help="as --plot-only, from the tables these calls printed into their logs")
    args = p.parse_args(argv)
    try:  # every value checked here, before any slow work
        if args.plot_only and args.from_log:
            raise ValueError("--plot-only and --from-log: pass one of them")
        for flag, files in (("--plot-only", args.plot_only), ("--from-log", args.from_log)):
            missing = [str(f) for f in files or [] if not f.is_file()]
            if missing:
                raise ValueError(f"{flag}: no such file {', '.join(missing)}")
            if files:
                return args
        args.formats = parse_formats(args.formats)
        args.lengths = parse_lengths(args.lengths)
        args.stages = [s for s in args.stages.split(",") if s]
        if not args.stages or set(args.stages) - set(STAGE_MIN_S):
            raise ValueError(f"--stages takes ours, llamacpp or both, got {args.stages}")
        if args.deadline <= 0 or min(args.repeats, args.threads, args.lcpp_reps) < 1:
            raise ValueError("--deadline must be > 0 s and --repeats, --threads, --lcpp-reps "
                             f">= 1, got {args.deadline}, {args.repeats}, {args.threads}, "
                             f"{args.lcpp_reps}")
        if "llamacpp" in args.stages:
            if args.peer_dir is None:
                raise ValueError("--peer-dir is needed for llama.cpp (or --stages ours)")
            llama_kit.check_kit(args.peer_dir)
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))
    return args


def stream(cmd: list[str], log: Path, timeout: float, on_line: Callable[[str], None]) -> str:
    """Runs `cmd`, each output line into `log` and to `on_line` as it comes; cut at `timeout` s
    (SIGINT, then SIGKILL). Returns "ok", "timed out" or "exit N"."""
    print(f"+ {' '.join(cmd)}   ({timeout:.0f} s)", flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        cut = threading.Event()

        def expire() -> None:
            cut.set()
            llama_kit.stop(proc)

        timer = threading.Timer(max(timeout, 1), expire)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                out.flush()
                on_line(line)
            code = proc.wait()
        finally:
            timer.cancel()
    return "timed out" if cut.is_set() else "ok" if code == 0 else f"exit {code}"


def ours(args: argparse.Namespace, fmt: str, entry: dict[str, Any], save: Callable[[], None],
         timeout: float) -> str:
    """bench_prefill.py in `auto` mode; each length's row lands in `entry` (and the JSON) as it
    prints; its final JSON adds the H2D rate, bytes per pass and machine."""
    out = args.work / f"ours_{fmt}"
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[int, dict[str, Any]] = {}
    mine = entry.setdefault("ours", {"rows": []})

    def on_line(line: str) -> None:
        try:
            record = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            record = None  # a log line that happens to start with a brace
        if isinstance(record, dict) and "tokens" in record:  # a length's row, or its resident pass
            rows.setdefault(record["tokens"], {}).update(record)
            mine["rows"] = [rows[n] for n in sorted(rows)]
            save()

    cmd = [sys.executable, str(PREFILL_SCRIPT), "--shape", SHAPE, "--weight-format", fmt,
           "--lengths", ",".join(map(str, args.lengths)), "--modes", "auto", "--repeats",
           str(args.repeats), "--out", str(out)] + (["--resident-pass"] if args.resident_pass
                                                     else [])
    status = stream(cmd, args.logs / f"ours_{fmt}.log", timeout, on_line)
    final = out / f"prefill_{SHAPE}_{fmt}.json"
    if final.exists():
        shutil.copy(final, args.logs / final.name)
        whole = json.loads(final.read_text())
        mine.update({k: whole[k] for k in ("h2d_gb_s", "packed_bytes_per_pass", "split_costs",
                                           "distinct_experts_per_512", "build_s", "machine",
                                           "packed_kernels") if k in whole})
        save()
    return status


def llamacpp(args: argparse.Namespace, fmt: str, entry: dict[str, Any], save: Callable[[], None],
             left: Callable[[float], float]) -> str:
    """The kit's GGUF of `fmt`'s peer type, then one llama-bench call per length (its rows in
    `entry` and the JSON after each); the GGUF is removed at the end (tmpfs)."""
    work = args.work / "lcpp"
    peer = entry.setdefault("llamacpp", {"gguf_type": PEER_TYPES[fmt], "dense_type": DENSE_TYPE,
                                         "ncmoe": moe_layer_count(SHAPE),
                                         "threads": args.threads, "rows": [], "calls": {}})
    bin_, env = llama_kit.unpack_llama_bench(args.peer_dir, work)
    start = time.monotonic()
    gguf = llama_kit.write_gguf(args.peer_dir, work, PEER_TYPES[fmt], DENSE_TYPE,
                                args.logs / f"gguf_{fmt}.log", min(300.0, left(60)))
    peer["gguf_s"] = round(time.monotonic() - start, 1)
    status = "ok"
    try:
        for n in args.lengths:
            if left(5) < 15:
                return "cut by the deadline"
            cli = bench_args(str(gguf), [peer["ncmoe"]], args.threads, n, 0, ubatches(n),
                             args.lcpp_reps)
            rows_file = args.logs / f"lcpp_{fmt}_{n}.jsonl"
            start = time.monotonic()
            status = llama_kit.run([str(bin_), *cli], args.logs / f"lcpp_{fmt}_{n}.log",
                                   left(5), rows_file, env)
            peer["rows"] += parse_rows(rows_file.read_text()) if rows_file.exists() else []
            peer["calls"][str(n)] = [round(time.monotonic() - start, 1), status]
            save()
            if status != "ok":
                return f"{n} tokens: {status}"
    finally:
        gguf.unlink(missing_ok=True)
    return status


def machine() -> dict[str, str]:
    """The GPU (nvidia-smi, when there is one) and the CPU model, without touching CUDA here."""
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               "?")
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpu = ""
    return {"gpu": gpu or "none", "cpu": cpu}


def report(result: dict[str, Any], out: Path) -> None:
    """OUT/NAME.md (printed) and OUT/NAME.png of `result` (one call's or a merge's)."""
    calls = "; ".join(f"`{c['command']}` ({c['date']}, git {c['git']}, {c['machine']['gpu']})"
                      for c in result["calls"])
    sources = [c["source"] for c in result["calls"] if "source" in c]
    drawn = f"Drawn from the {'; '.join(sources)} (their JSON was lost).\n\n" if sources else ""
    text = f"Calls: {calls}\n\n{drawn}{table(result)}\n"
    (out / f"{NAME}.md").write_text(text)
    print(text)
    plot(result, out / f"{NAME}.png", f"{SHAPE} prefill, experts in host memory")


def load(path: Path) -> Any:
    """A call's JSON; ValueError naming the file when it is not JSON (a copy cut short)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from exc


def pack_logs(logs: Path, tar: Path) -> None:
    """Every file in `logs` into one tar (flat), written beside and then renamed: a call cut
    while it packs keeps the previous tar."""
    part = tar.with_suffix(".part")
    with tarfile.open(part, "w:gz") as out:
        for f in sorted(logs.iterdir()):
            out.add(f, arcname=f.name)
    part.replace(tar)


def redraw(args: argparse.Namespace) -> None:
    """--plot-only / --from-log: several calls' JSON, or their printed tables, as one."""
    try:
        merged = (merge([(str(f), load(f)) for f in args.plot_only]) if args.plot_only else
                  merge([(str(f), parse_log(f.read_text(), str(f))) for f in args.from_log]))
    except ValueError as exc:
        sys.exit(f"{'--plot-only' if args.plot_only else '--from-log'}: {exc}")
    (args.out / f"{NAME}.json").write_text(json.dumps(merged, indent=1))
    report(merged, args.out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only or args.from_log:
        redraw(args)
        return
    temp = args.work is None
    args.work = Path(tempfile.mkdtemp(prefix=f"{NAME}_")) if temp else args.work
    args.logs = args.work / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    try:
        run(args, argv)
    finally:
        if temp:
            shutil.rmtree(args.work, ignore_errors=True)


def run(args: argparse.Namespace, argv: list[str] | None) -> None:
    """Every (format, stage) of the plan, the JSON after each point, the logs' tar after each
    stage, then the table and PNG."""
    from hetmoe.bench.harness import git_sha, now_utc

    end = time.monotonic() + args.deadline
    command = " ".join(["benchmarks/peers/prefill_vs_llamacpp.py",
                        *(argv if argv is not None else sys.argv[1:])])
    result: dict[str, Any] = {"calls": [{"command": command, "date": now_utc(), "git": git_sha(),
                                         "machine": machine()}],
                              "shape": SHAPE, "lengths": args.lengths, "formats": {},
                              "timings": {}}
    path = args.out / f"{NAME}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    plan = [(fmt, s) for fmt in args.formats for s in args.stages]
    for i, (fmt, stage) in enumerate(plan):
        entry = result["formats"].setdefault(fmt, {})
        reserve = sum(STAGE_MIN_S[s] for _, s in plan[i + 1:])

        def left(extra: float, reserve: float = reserve) -> float:
            """Seconds to the deadline less the later stages' share and `extra`."""
            return end - time.monotonic() - reserve - extra

        start = time.monotonic()
        try:
            status = (ours(args, fmt, entry, save, left(0)) if stage == "ours" else
                      llamacpp(args, fmt, entry, save, left))
        except (RuntimeError, subprocess.CalledProcessError, OSError, ValueError) as exc:
            status = f"failed: {exc}"
        result["timings"][f"{fmt}/{stage}"] = [round(time.monotonic() - start, 1), status]
        print(f"== {fmt}/{stage}: {status} in {result['timings'][f'{fmt}/{stage}'][0]} s",
              flush=True)
        save()
        pack_logs(args.logs, args.out / f"{NAME}_logs.tgz")
    report(result, args.out)

if __name__ == "__main__":
    main()
