"""CPU thread pool: submit -> wait overhead, against a plain Python queue hand-off.

Rows (each the median / p90 of `--iters` timed runs after a warm-up):
  empty job        one phase, no tasks: the pure hand-off (publish, barrier, completion);
  small job        one phase, `--tasks` trivial tasks per worker, pulled from the group counters;
  woken job        an empty job submitted after the workers parked (idle > 50 ms): the futex path;
  python queue     a `threading` worker takes an item from a `queue.Queue`, answers on another.

Usage: python benchmarks/kernels/bench_pool.py [--iters 5000] [--tasks 4] [--json bench_pool.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from pathlib import Path

from hetmoe import _cpu, _cpu_testing
from hetmoe.machine import machine_report, source_commit


def python_queue_handoff(iters: int, warmup: int = 200) -> dict[str, float]:
    """Round trip main -> worker -> main through two queue.Queue objects, in microseconds."""
    requests: queue.Queue[int | None] = queue.Queue()
    replies: queue.Queue[int] = queue.Queue()

    def worker() -> None:
        while (item := requests.get()) is not None:
            replies.put(item)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    samples = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        requests.put(i)
        replies.get()
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e6)
    requests.put(None)
    thread.join()
    samples.sort()
    return summarize(samples)


def woken_job(rounds: int) -> dict[str, float]:
    """An empty job after the workers have parked: sleep past the idle period, then time one."""
    idle_s = _cpu.pool_info()["idle_before_park_us"] * 1e-6
    samples = []
    for _ in range(rounds):
        time.sleep(idle_s * 2)
        samples.append(_cpu_testing.pool_overhead_us(1, 0, warmup=0)["median_us"])
    samples.sort()
    return summarize(samples)


def summarize(samples: list[float]) -> dict[str, float]:
    """Median / p90 / min of sorted microsecond samples."""
    return {
        "iters": len(samples),
        "median_us": statistics.median(samples),
        "p90_us": samples[min(len(samples) - 1, len(samples) * 9 // 10)],
        "min_us": samples[0],
    }


def git_sha() -> str:
    return source_commit(Path(__file__).resolve().parents[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5000, help="timed runs per row")
    parser.add_argument("--tasks", type=int, default=4, help="small job: tasks per worker")
    parser.add_argument("--woken", type=int, default=20, help="timed runs of the parked case")
    parser.add_argument("--json", type=Path, default=Path("bench_pool.json"), help="output file")
    args = parser.parse_args()

    info = _cpu.pool_info()
    tasks_per_group = args.tasks * max(info["group_sizes"])
    rows = {
        "empty job": _cpu_testing.pool_overhead_us(args.iters, 0),
        f"small job ({tasks_per_group} tasks/group)": _cpu_testing.pool_overhead_us(
            args.iters, tasks_per_group
        ),
        "woken job (after park)": woken_job(args.woken),
        "python queue hand-off": python_queue_handoff(args.iters),
    }
    baseline = rows["python queue hand-off"]["median_us"]

    print(
        f"pool: {info['threads']} workers in {info['groups']} group(s) {info['group_sizes']}, "
        f"pinned {info['pinned_threads']}, CPUs {info['worker_cpus']}"
    )
    print(f"{'case':<34}{'median µs':>11}{'p90 µs':>10}{'min µs':>10}{'queue/this':>12}")
    for name, row in rows.items():
        ratio = baseline / row["median_us"]
        print(
            f"{name:<34}{row['median_us']:>11.2f}{row['p90_us']:>10.2f}{row['min_us']:>10.2f}"
            f"{ratio:>12.1f}"
        )

    result = {
        "benchmark": "bench_pool",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "git_sha": git_sha(),
        "machine": machine_report(),
        "config": {"iters": args.iters, "tasks_per_worker": args.tasks, "woken": args.woken},
        "pool": info,
        "results": rows,
        "ratio_queue_over_empty_job": baseline / rows["empty job"]["median_us"],
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
