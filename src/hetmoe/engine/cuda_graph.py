"""`HybridRunner`: the model runner with CPU/GPU overlap and decode steps as CUDA graphs.

Each decode batch size in `HybridConfig.graph_batch_sizes` and attention window bucket gets one CUDA
graph of the forward pass (embedding to final norm), captured at its first use; the CPU experts'
start and wait enter it as stream memory operations on ready/done words (or host nodes), reading and
writing fixed pinned buffers (engine/host_link.py). A fused step with the flag signal is captured
in two parts, split before decoder layer `graph_split_layer`: a launch costs the CPU about a
microsecond per node, and the GPU runs the first part while the CPU launches the second. The CPU
jobs a step starts are recorded at capture and queued in the pool between the two launches, where
each waits for its ready word. A batch is padded to the next captured size
by repeating its first row (same token, slot and position: the cache write is the same, the extra
outputs are dropped). Graphs need a static shape, and attention should cost what the cache holds: a
step attends over the first W cache entries (masked causally), W = the window bucket of the batch's
longest length after the step (ops/kv_batch.py `window_bucket`: `smallest_window` * 2**k, capped at
`max_seq_len`), in both modes, which keeps the eager mode (`cuda_graphs=False`, for debugging)
token-for-token equal to the graphs. Masked entries weigh exp(-inf) = 0, so W changes no result,
only summation order. A decode step runs `FusedDecoder` (engine/fused_decode.py: one compiled
function per layer) when the model fits and `HybridConfig.fused` is set, else the HF decoder layers.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetmoe.engine.fused_decode import FusedDecoder, plan_layers
from hetmoe.engine.host_link import SIGNALS, HostLink, Signal
from hetmoe.engine.overlap import MoEOverlap
from hetmoe.engine.runner import ModelRunner
from hetmoe.ops.kv_batch import KVBatch, window_bucket

if TYPE_CHECKING:
    from hetmoe.ops.moe import HybridMoE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HybridConfig:
    """Options of the hybrid runtime (overlap, deferral, CUDA graphs)."""

    deferred: int = 0
    """Experts per token deferred to the next MoE layer in decode (0 = off)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (False: the same steps launched eagerly)."""
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Decode batch sizes that get a graph; larger batches run eagerly."""
    signal: Signal = "flags"
    """How the GPU stream starts and awaits CPU experts: "flags" or "host_functions"."""
    fused: bool = True
    """Decode through one function per layer (engine/fused_decode.py) when the model fits."""
    compile: bool = True
    """On a GPU, compile those functions with torch.compile (False: run them eagerly)."""
    smallest_window: int = 256
    """Smallest attention window bucket of a decode step (>= max_seq_len: always the whole
    cache window)."""

    graph_split_layer: int = 4
    """Fused decode graphs with the "flags" signal are captured as two, split before this decoder
    layer (0 or beyond the last layer: one graph): launching a graph costs the CPU about a
    microsecond per node, and the second, long launch then runs while the GPU runs the first.
    The step's CPU jobs are queued between the two launches (before a single one), so the first
    part must be short: a launch can block once the GPU waits for a job not yet queued."""

    def __post_init__(self) -> None:
        sizes = self.graph_batch_sizes
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"graph_batch_sizes must be positive integers, got {sizes!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if not isinstance(self.graph_split_layer, int) or self.graph_split_layer < 0:
            raise ValueError(f"graph_split_layer must be an integer >= 0, got "
                             f"{self.graph_split_layer!r}")
        if not isinstance(self.smallest_window, int) or self.smallest_window < 2:
            # A compiled dimension of width 1 would be specialized, not dynamic.
            raise ValueError(f"smallest_window must be an integer >= 2, got "
                             f"{self.smallest_window!r}")


@dataclass
class _Ahead:
    """A greedy decode step launched before the previous one's token was read."""

    token: torch.Tensor  # [1, 1] int64 on the GPU: the step's argmax, the next step's input
    host: torch.Tensor  # [1, 1] pinned: its copy for the host
    done: torch.cuda.Event  # recorded after that copy
    jobs: list[tuple[HostLink, int]]  # the step's flag jobs (MoEOverlap.take_pending)


@dataclass
class _Graph:
    """One captured decode step and its static tensors."""

    parts: list[torch.cuda.CUDAGraph]  # replayed in order (HybridConfig.graph_split_layer)
    ids: torch.Tensor  # [B, 1]
    positions: torch.Tensor  # [B, 1]
    slots: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, 1, H] output
    jobs: list[tuple[HostLink, int]]  # flag-gated CPU jobs the step starts (link, deferred
    # slots chained), in stream order
    capture_s: float = 0.0  # wall time of the capture alone (after its eager warm-up step)


class HybridRunner(ModelRunner):
    """`ModelRunner` (same interface) whose MoE layers overlap CPU experts with GPU work."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 max_batch: int, max_seq_len: int, config: HybridConfig | None = None) -> None:
        super().__init__(model, device, dtype, max_batch, max_seq_len)
        self.config = config or HybridConfig()
        plans_error = ""
        if self.config.fused:
            try:
                plan_layers(model)
            except ValueError as exc:
                plans_error = str(exc)
                log.info("fused decode does not fit this model (%s): module path", exc)
        fused = self.config.fused and not plans_error
        self.overlap = MoEOverlap(model, device, max(max_batch, *self.config.graph_batch_sizes),
                                  self.config.deferred, self.config.signal, packed=fused)
        self.fused = FusedDecoder(model, self.overlap, self.config.compile
                                  and device.type == "cuda") if fused else None
        self.use_graphs = self.config.cuda_graphs and device.type == "cuda"
        if self.config.cuda_graphs and not self.use_graphs:
            log.info("CUDA graphs need a CUDA device (running on %s): decode runs eagerly", device)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        """Captured steps by (batch size, window bucket)."""
        self.windows: Counter[int] = Counter()
        """Decode steps run per window bucket (graphs or eager) since this runner was made."""

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """See `ModelRunner.decode`; runs as a decode step (deferral, graphs)."""
        with self.overlap.phase(decoding=True):
            try:
                logits = super().decode(slots, token_ids)
                if self.device.type == "cuda":
                    # Sleep, not spin, until the step is done: a CUDA sync spins by default, and
                    # the CPU experts' workers need every core but this one.
                    done = torch.cuda.Event(blocking=True)
                    done.record()
                    done.synchronize()
            except BaseException:
                self.overlap.abort_step()  # queued CPU jobs must not wait for a step never run
                raise
        self.overlap.finish_step()
        return logits

    def greedy(self, slot: int, token: int,
               limit: int | None = None) -> Generator[int, None, None]:
        """See `ModelRunner.greedy`. With CUDA graphs each step is launched before the previous
        step's token is read, its input being that step's argmax on the GPU: the host's work
        between steps and the GPU's end of a step (final norm, lm_head) no longer leave the CPU
        experts idle. A consumer that stops discards the step launched ahead (it is waited for,
        and its cache entry lies beyond the slot's length again); with `limit`, no step beyond
        the last token wanted is launched."""
        if not self.use_graphs:
            yield from super().greedy(slot, token, limit)
            return
        self.cache.check_slot(slot)
        self._check_ids([token])
        if self.lengths[slot] == 0:
            raise ValueError(f"slot {slot} holds no tokens; greedy decode needs a prefilled slot")
        ahead: list[_Ahead] = []
        try:
            ids = torch.tensor([[token]]).to(self.device)
            launched = 0

            def wanted() -> bool:  # another step fits the window and the limit
                return self.lengths[slot] < self.max_seq_len and (limit is None
                                                                  or launched < limit)

            while True:
                if wanted():
                    ahead.append(self._launch_greedy(slot, ids))
                    ids = ahead[-1].token
                    launched += 1
                if not ahead:
                    return
                if len(ahead) == 1 and wanted():
                    continue  # the first step: launch the one after it before waiting
                yield self._finish_ahead(ahead.pop(0))
        except BaseException as exc:
            failed = not isinstance(exc, GeneratorExit)
            if not failed:
                try:
                    while ahead:  # launched ahead, never read
                        self._finish_ahead(ahead[0])
                        ahead.pop(0)
                        self.lengths[slot] -= 1
                except BaseException:
                    failed = True
            if failed:
                self.overlap.abort_step([job for step in ahead for job in step.jobs])
                self.lengths[slot] -= len(ahead)
            raise

    @torch.inference_mode()
    def _launch_greedy(self, slot: int, ids: torch.Tensor) -> _Ahead:
        """Launches one greedy decode step of `slot` on ids [1, 1] (on the GPU)."""
        start = self.lengths[slot]
        index = torch.tensor([[start], [slot]], pin_memory=True).to(self.device, non_blocking=True)
        kv = KVBatch(index[1], index[0:1], start + 1)
        with self.overlap.phase(decoding=True):
            hidden = self._forward(ids, kv)[:, 0]  # [1, H]
        self.lengths[slot] += 1
        token = self.model.lm_head(hidden).float().argmax(-1, keepdim=True)  # [1, 1]
        host = torch.empty(1, 1, dtype=torch.int64, pin_memory=True)
        host.copy_(token, non_blocking=True)
        done = torch.cuda.Event(blocking=True)  # sleep, not spin, on it (see `decode`)
        done.record()
        return _Ahead(token, host, done, self.overlap.take_pending())

    def _finish_ahead(self, step: _Ahead) -> int:
        """Waits for a launched greedy step and its CPU jobs; its token."""
        step.done.synchronize()
        self.overlap.finish_step(step.jobs)
        return int(step.host[0, 0])

    def _forward(self, ids: torch.Tensor, kv: KVBatch) -> torch.Tensor:
        if not self.overlap.decoding:
            return super()._forward(ids, kv)
        b = ids.shape[0]
        width = window_bucket(kv.kv_len, self.config.smallest_window, self.max_seq_len)
        self.windows[width] += 1
        size = next((s for s in sorted(self.config.graph_batch_sizes) if s >= b), None)
        if not (self.use_graphs and self.device.type == "cuda") or size is None:
            return self._step(ids, KVBatch(kv.slots, kv.positions, width))
        pad = size - b
        ids = torch.cat([ids, ids[:1].expand(pad, 1)]) if pad else ids  # [size, 1]
        positions = torch.cat([kv.positions, kv.positions[:1].expand(pad, 1)]) if pad \
            else kv.positions
        slots = torch.cat([kv.slots, kv.slots[:1].expand(pad)]) if pad else kv.slots
        graph = self.graphs.get((size, width))
        if graph is None:
            return self._capture(size, width, ids, positions, slots)[:b]
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

    def _step(self, ids: torch.Tensor, kv: KVBatch,
              before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One decode step's forward: fused layer functions (calling `before_layer(n)` before
        decoder layer n), or the HF layers."""
        if self.fused is not None:
            return self.fused.forward(ids, kv, before_layer)
        return super()._forward(ids, kv)

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
            out = self._step(static.ids, kv)  # warm-up (and compile) = this step's result
        torch.cuda.current_stream(self.device).wait_stream(side)
        out = out.clone()
        # The capture records work without running it: the cache and buffers stay as they are.
        start = time.perf_counter()
        captures = [torch.cuda.graph(static.parts[0])]

        def split(n: int) -> None:
            # Decoder layer n starts the second graph, in the first one's memory pool.
            # Host functions keep one graph: only the flag signal was checked with split graphs.
            if n == 0 or n != self.config.graph_split_layer or self.config.signal != "flags":
                return
            captures[-1].__exit__(None, None, None)
            static.parts.append(torch.cuda.CUDAGraph())
            captures.append(torch.cuda.graph(static.parts[-1], pool=static.parts[0].pool()))
            captures[-1].__enter__()

        self.overlap.begin_capture()
        try:
            captures[0].__enter__()
            try:
                static.hidden = self._step(static.ids, kv, split)
            finally:
                captures[-1].__exit__(*sys.exc_info())
        finally:
            static.jobs = self.overlap.end_capture()
        static.capture_s = time.perf_counter() - start
        self.graphs[size, width] = static
        return out

    def reset_graphs(self, deferred: int | None = None) -> None:
        """Drops the captured graphs (e.g. to change `deferred`, which graphs bake in)."""
        if deferred is not None:
            from hetmoe.ops.deferral import check_deferred

            check_deferred(deferred, self.overlap.top_k)
            self.overlap.deferred = deferred
        self.graphs.clear()


def make_runner(model: nn.Module, device: torch.device, dtype: torch.dtype, max_batch: int,
                max_seq_len: int, config: HybridConfig | None = None) -> ModelRunner:
    """The engine's runner: `HybridRunner` on a GPU when every MoE layer's routed experts are in
    the CPU backend (the case overlap and graphs are for), else the plain `ModelRunner`."""
    from hetmoe.engine.overlap import cpu_moe_of
    from hetmoe.ops.deferral import moe_layers

    def on_cpu_backend(moe: HybridMoE) -> bool:
        try:
            cpu_moe_of(moe.experts)
        except ValueError:
            return False
        return True

    layers = moe_layers(model)
    hybrid = device.type == "cuda" and bool(layers) and all(map(on_cpu_backend, layers))
    if not hybrid:
        return ModelRunner(model, device, dtype, max_batch, max_seq_len)
    return HybridRunner(model, device, dtype, max_batch, max_seq_len, config)
