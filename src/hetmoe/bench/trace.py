"""Timeline of decode steps: GPU work and CPU expert tasks per MoE layer, as a Chrome trace.

`MoEOverlap` calls `mark(label, layer)` at each stage of a layer; on CUDA every mark records an
event on the current stream, so its time is when the stream got there (after a wait on the CPU:
when the stream passed it). Spans are built from consecutive marks:

- GPU track: `attention L` (previous layer's end to this layer's start: attention, norms,
  residuals), `route+copy L`, `shared L`, `wait L` (GPU idle until the CPU result is there),
  `combine L`;
- CPU track: `experts L` from the submit to the end of the wait (the CPU task is done when the
  wait returns; if the GPU reaches the wait late, the span ends late too), `deferred L` from its
  submit to the wait at the next layer.

Open the JSON in chrome://tracing or ui.perfetto.dev. Marks add work to the stream, so traced
steps run in eager mode and are not the timed ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# GPU span that ends at a mark: (mark that starts it, span name).
_STAGES = {
    "submitted": ("moe_start", "route+copy"),
    "shared_done": ("submitted", "shared"),
    "waited": ("shared_done", "wait"),
    "moe_end": ("waited", "combine"),
}


@dataclass
class _Mark:
    label: str
    layer: int
    step: int
    event: torch.cuda.Event | None
    host_time: float


@dataclass
class TraceRecorder:
    """Collects marks over several steps; `events()` turns them into Chrome trace events."""

    cuda: bool
    marks: list[_Mark] = field(default_factory=list)
    step: int = 0
    _origin: torch.cuda.Event | None = None
    _origin_time: float = 0.0

    def begin_step(self) -> None:
        """Starts a new step (call before each traced decode step)."""
        self.step += 1
        self.mark("step_start", -1)

    def mark(self, label: str, layer: int) -> None:
        """Records that the stream (or, without CUDA, the host) reached `label` of `layer`."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            if self._origin is None:
                self._origin = event
        if not self.marks:
            self._origin_time = time.perf_counter()
        self.marks.append(_Mark(label, layer, self.step, event, time.perf_counter()))

    def _us(self, mark: _Mark) -> float:
        if mark.event is not None and self._origin is not None:
            return float(self._origin.elapsed_time(mark.event)) * 1e3
        return (mark.host_time - self._origin_time) * 1e6

    def events(self) -> list[dict[str, Any]]:
        """Complete ('X') events in microseconds: pid 0 = GPU stream, pid 1 = CPU experts."""
        if self.cuda:
            torch.cuda.synchronize()
        out: list[dict[str, Any]] = []
        at = {(m.step, m.label, m.layer): self._us(m) for m in self.marks}
        previous_end: dict[int, float] = {}
        for m in self.marks:
            t = at[(m.step, m.label, m.layer)]
            if m.label == "step_start":
                previous_end[m.step] = t
            elif m.label == "moe_start":
                out.append(_span(f"attention L{m.layer}", 0, previous_end[m.step], t, m.step))
            elif m.label == "moe_end":
                previous_end[m.step] = t
            if m.label in _STAGES:
                start_label, name = _STAGES[m.label]
                begin = at[(m.step, start_label, m.layer)]
                out.append(_span(f"{name} L{m.layer}", 0, begin, t, m.step))
            if m.label == "waited":
                out.append(_span(f"experts L{m.layer}", 1, at[(m.step, "submitted", m.layer)],
                                 t, m.step))
            if m.label == "deferred_waited":
                begin = at[(m.step, "deferred_submitted", m.layer)]
                out.append(_span(f"deferred L{m.layer}", 1, begin, t, m.step))
        return out

    def write(self, path: str | Path) -> dict[str, Any]:
        """Writes the Chrome trace JSON to `path`; returns a per-span-kind summary (mean µs)."""
        events = self.events()
        meta = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "GPU stream"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "CPU experts"}},
        ]
        Path(path).write_text(json.dumps({"traceEvents": meta + events}))
        return summarize(events)


def _span(name: str, pid: int, begin: float, end: float, step: int) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": round(begin, 3),
            "dur": round(max(end - begin, 0.0), 3), "args": {"step": step}}


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean duration (µs) per span kind (`attention`, `experts`, ...) and the step time."""
    kinds: dict[str, list[float]] = {}
    for e in events:
        kinds.setdefault(e["name"].split(" L")[0], []).append(e["dur"])
    steps = {e["args"]["step"] for e in events}
    gpu = [e for e in events if e["pid"] == 0]
    per_step = [max(e["ts"] + e["dur"] for e in gpu if e["args"]["step"] == s)
                - min(e["ts"] for e in gpu if e["args"]["step"] == s) for s in steps]
    return {
        "mean_us": {k: round(sum(v) / len(v), 1) for k, v in sorted(kinds.items())},
        "count_per_step": {k: len(v) // max(len(steps), 1) for k, v in sorted(kinds.items())},
        "step_us": round(sum(per_step) / max(len(per_step), 1), 1),
    }
