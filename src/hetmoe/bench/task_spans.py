"""The CPU backend's task spans (`_cpu_testing.task_spans`) read as numbers and as a trace.

A span is `[phase, group, worker, start_ns, end_ns]`; phases in the order the layer runs them.
`benchmarks/kernels/bench_cpu_moe.py` prints the busy shares and writes the traces."""

from __future__ import annotations

PHASES = ("convert", "gather", "gate/up", "down", "combine")
"""The phases of one CpuMoE call, indexed by a span's first field."""


def busy_shares(spans: list[list[int]]) -> list[float]:
    """Per phase: the workers' summed task time over (the phase's wall time x the call's workers):
    1.0 when every worker runs that phase's tasks from its first start to its last end."""
    workers = len({(g, w) for _, g, w, _, _ in spans}) or 1
    shares = []
    for p in range(len(PHASES)):
        mine = [(start, end) for slot, _, _, start, end in spans if slot == p]
        wall = max(e for _, e in mine) - min(s for s, _ in mine) if mine else 0
        shares.append(sum(e - s for s, e in mine) / (wall * workers) if wall else 0.0)
    return shares


def chrome_trace(spans: list[list[int]]) -> dict:
    """The spans as a Chrome / Perfetto trace: one row per worker, microseconds from the call's
    first task."""
    t0 = min(s[3] for s in spans)
    return {"traceEvents": [
        {"name": PHASES[slot], "ph": "X", "pid": g, "tid": w, "ts": (start - t0) / 1e3,
         "dur": (end - start) / 1e3} for slot, g, w, start, end in spans]}
