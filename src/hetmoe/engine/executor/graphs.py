"""`GraphCache`: decode steps captured as CUDA graphs, one per (batch size, attention window).

Each decode batch size (`graph_sizes`: `EngineConfig.graph_batch_sizes`, then doublings up to
`max_batch`) and window bucket gets one CUDA graph of the forward pass (embedding to final norm),
captured at its first use; the CPU experts' start and wait enter it as stream memory operations on
ready/done words (engine/executor/host_link.py). A fused step is captured in two parts, split before
decoder layer `graph_split_layer`: a launch costs the CPU about a microsecond per node, and the GPU
runs the first part while the CPU launches the second. The CPU jobs a step starts are recorded at
capture and queued in the pool between the two launches, where each waits for its ready word. A
batch is padded to the next captured size by repeating its first row (same token, slot and
position: the cache write is the same, the extra outputs are dropped).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.host_link import HostLink
from hetmoe.engine.executor.overlap import MoEOverlap
from hetmoe.ops.kv_batch import KVBatch

StepFn = Callable[[torch.Tensor, KVBatch, Callable[[int], None] | None], torch.Tensor]
"""(ids [B, 1], kv, before_layer) -> final hidden [B, 1, H]: one decode step's forward."""


@dataclass
class _Graph:
    """One captured decode step and its static tensors."""

    parts: list[torch.cuda.CUDAGraph]  # replayed in order (EngineConfig.graph_split_layer)
    ids: torch.Tensor  # [B, 1]
    positions: torch.Tensor  # [B, 1]
    slots: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, 1, H] output
    jobs: list[tuple[HostLink, int]]  # flag-gated CPU jobs the step starts (link, deferred
    # slots chained), in stream order
    capture_s: float = 0.0  # wall time of the capture alone (after its eager warm-up step)


def graph_sizes(configured: tuple[int, ...], max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes: `configured`, then the largest doubled while below `max_batch`,
    and `max_batch` itself, so every decode batch the cache holds replays a graph (graphs are
    captured at first use: only the sizes a run reaches take memory)."""
    sizes = set(configured)
    size = max(sizes)
    while size < max_batch:
        size = min(2 * size, max_batch)
        sizes.add(size)
    return tuple(sorted(sizes))


class GraphCache:
    """Captures and replays decode steps of `step` (see the module docstring)."""

    def __init__(self, config: EngineConfig, device: torch.device, overlap: MoEOverlap,
                 step: StepFn, max_batch: int = 1) -> None:
        self.sizes = graph_sizes(config.graph_batch_sizes, max_batch)
        self.split_layer = config.graph_split_layer  # only the fused step calls before_layer
        self.device, self.overlap, self.step = device, overlap, step
        self.graphs: dict[tuple[int, int], _Graph] = {}
        """Captured steps by (batch size, window bucket)."""

    def size_for(self, batch: int) -> int | None:
        """The captured batch size a batch of `batch` rows runs at (None: too large, eager)."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, ids: torch.Tensor, kv: KVBatch, size: int) -> torch.Tensor:
        """The step's final hidden [B, 1, H] for ids [B, 1], padded to `size` rows; kv.kv_len
        is the window bucket."""
        b = ids.shape[0]
        pad = size - b
        if pad:
            ids = torch.cat([ids, ids[:1].expand(pad, 1)])  # [size, 1]
            positions = torch.cat([kv.positions, kv.positions[:1].expand(pad, 1)])
            slots = torch.cat([kv.slots, kv.slots[:1].expand(pad)])
        else:
            positions, slots = kv.positions, kv.slots
        graph = self.graphs.get((size, kv.kv_len))
        if graph is None:
            return self._capture(size, kv.kv_len, ids, positions, slots)[:b]
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.slots.copy_(slots)
        for link in self.overlap.host:
            link.bind(size)  # another size may have been bound since this graph's capture
        if len(graph.parts) == 1:
            # One launch of a whole step can block once the GPU waits on the first done word
            # (its queue fills), and that word needs a job queued: queue the jobs first.
            self.overlap.submit_recorded(graph.jobs)
            graph.parts[0].replay()
            return graph.hidden[:b]
        # The first part's short launch starts the GPU; the jobs are queued and the long launch
        # of the rest made while it runs (a job whose ready word is already set starts at once).
        graph.parts[0].replay()
        self.overlap.submit_recorded(graph.jobs)
        for part in graph.parts[1:]:
            part.replay()
        return graph.hidden[:b]

    def _capture(self, size: int, width: int, ids: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        """Runs this step eagerly (its real output) and captures it for later steps of this
        batch size and window bucket."""
        static = _Graph([torch.cuda.CUDAGraph()], ids.clone(), positions.clone(), slots.clone(),
                        torch.empty(0), [])
        kv = KVBatch(static.slots, static.positions, width)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self.step(static.ids, kv, None)  # warm-up (and compile) = this step's result
        torch.cuda.current_stream(self.device).wait_stream(side)
        out = out.clone()
        # The capture records work without running it: the cache and buffers stay as they are.
        start = time.perf_counter()
        captures = [torch.cuda.graph(static.parts[0])]

        def split(n: int) -> None:
            # Decoder layer n starts the second graph, in the first one's memory pool.
            if n == 0 or n != self.split_layer:
                return
            captures[-1].__exit__(None, None, None)
            static.parts.append(torch.cuda.CUDAGraph())
            captures.append(torch.cuda.graph(static.parts[-1], pool=static.parts[0].pool()))
            captures[-1].__enter__()

        # No garbage collection inside the capture: an object of an earlier runner or graph
        # freed then (its CUDA events, graphs, pinned buffers) makes a CUDA call the capture
        # forbids and the process aborts (seen on a device test run, gone with the GC off).
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        self.overlap.begin_capture()
        try:
            captures[0].__enter__()
            try:
                static.hidden = self.step(static.ids, kv, split)
            finally:
                captures[-1].__exit__(*sys.exc_info())
        finally:
            static.jobs = self.overlap.end_capture()
            if was_enabled:
                gc.enable()
        static.capture_s = time.perf_counter() - start
        self.graphs[size, width] = static
        return out
