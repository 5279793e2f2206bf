"""`MoEOverlap`: the MoE step of GPU decode with CPU experts, and the CPU jobs of each step.

The story of a MoE layer is `ops.moe_step.MoEStep`'s; this adds its transports and jobs:
prefill (and every pass without a GPU) uses each layer's `BackendLink` (Python submit / sync);
decode steps on a GPU use its `HostLink` (engine/executor/host_link.py): pinned buffers, async
copies and start/wait in stream order through ready/done words, so a CUDA graph can capture it. The
step's CPU jobs wait in the pool for their ready words: `MoEOverlap` submits them as the step is
launched (recorded at capture, queued as each replay is launched) and waits them in
`finish_step`; `abort_step` releases them when a step fails. A prefill pass streamed to the GPU
runs through `streamed`; where its experts run is the prefill planner's
(engine/executor/prefill_planner.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from hetmoe import env
from hetmoe.config import DEFAULT_DEFER_ORDER
from hetmoe.engine.executor.host_link import HostLink, check_stream_memops
from hetmoe.engine.placement.layer_stream import LayerStreamer, streaming_refusal
from hetmoe.engine.placement.placement_fetch import StagingPool
from hetmoe.engine.placement.placement_link import PlacementLink
from hetmoe.engine.placement.placement_plan import auto_budget
from hetmoe.engine.placement.slots import Placement
from hetmoe.engine.placement.staging_plan import streamer_cap
from hetmoe.engine.placement.stream_memory import staged_expert_bytes
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.ops.deferral import check_defer_order
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.moe_step import BackendLink, Link, MoEStep, backend_link

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 30.0
"""Seconds a failed step's stream gets to drain (done words held set) before giving up."""


def cpu_moe_of(backend: nn.Module) -> CpuMoE:
    """The `CpuMoE` inside an expert backend; ValueError when the layer's experts are not on it."""
    for value in vars(backend).values():
        if isinstance(value, CpuMoE):
            return value
    raise ValueError(
        f"overlap needs routed experts in the `cpu` backend; found {type(backend).__name__} "
        "(set experts: cpu in the rules or EngineConfig.experts)"
    )


def all_on_cpu_backend(model: nn.Module) -> bool:
    """Whether the model has MoE layers and every one's routed experts are in the CPU backend."""
    layers = moe_layers(model)
    try:
        for moe in layers:
            cpu_moe_of(moe.experts)
    except ValueError:
        return False
    return bool(layers)


class MoEOverlap(MoEStep):
    """`MoEStep` of every `HybridMoE` of a model with CPU experts (see the module docstring),
    attached at construction. `packed`: decode steps start with `start_packed` (fused decode);
    `defer_order`: which experts deferral defers (ops/deferral.py), kept by the placed links.
    HETMOE_GPU_EXPERT_MATH is read once here (`act_quant`, for the streamer and the runner's
    placement), not per packed kernel call."""

    def __init__(self, model: nn.Module, device: torch.device, max_batch: int,
                 deferred: int = 0, packed: bool = False,
                 defer_order: str = DEFAULT_DEFER_ORDER) -> None:
        layers = moe_layers(model)
        if not layers:
            raise ValueError("MoEOverlap: the model has no hybrid_moe layer")
        super().__init__(layers, self._link, deferred)
        check_stream_memops(device)
        self.device = device
        self.act_quant = env.gpu_expert_math() == "quantized"
        """GPU prefill's packed kernels on int8 / fp8 tensor cores (kernels/act_quant.py)."""
        self.cpu = cpu = [cpu_moe_of(m.experts) for m in layers]  # each layer's experts
        self.direct: list[BackendLink] = [backend_link(m) for m in layers]
        self.host: list[HostLink] = []
        if device.type == "cuda":
            dtype = layers[0].gate.weight.dtype  # activations' dtype
            self.host = [HostLink(c, max_batch, self.top_k, dtype, device, self._queue, packed)
                         for c in cpu]
        self.recorded: list[tuple[HostLink, int]] | None = None  # flag jobs (link, deferred)
        # of a step being captured
        self.pending: list[tuple[HostLink, int]] = []  # flag jobs submitted for this step
        self.streamer: LayerStreamer | None = None  # GPU prefill (made at its first pass)
        self.streaming = False
        self.placement: Placement | None = None  # experts resident on the GPU (`place`)
        self.placed: dict[tuple[bool, int], PlacementLink] = {}  # (host link?, layer)
        self.defer_order = defer_order
        self.attach()

    @property
    def defer_order(self) -> str:
        """Which experts deferral defers; only the placed links tell the orders apart (with
        every expert on the CPU each is a miss). Graphs bake it in: reset them after a change."""
        return self._defer_order

    @defer_order.setter
    def defer_order(self, order: str) -> None:
        check_defer_order(order)
        self._defer_order = order
        for link in self.placed.values():
            link.defer_order = order

    def place(self, placement: Placement | None, pool: StagingPool | None = None) -> None:
        """Computes `placement`'s resident experts on the GPU and sends only the misses to the
        CPU (engine/placement/placement_link.py), less those `pool` fetches (fetch-or-compute, steps
        outside graphs); None: every expert on the CPU again. A streamed prefill copies only
        the misses. Captured graphs bake in which layers start CPU jobs: reset them after a
        change (and tell the prefill planner: `ModelRunner.place` does both)."""
        self.placement, self.placed = placement, {}
        # The streamer's staging was sized beside the old placement (and it kept the last pass's
        # slots): freed, so the new plan sees its memory; the next streamed pass makes another.
        self.streamer = None
        if placement is None:
            return
        for i, slots in enumerate(placement.layers):
            if not slots.slots and pool is None:
                continue
            self.placed[False, i] = PlacementLink(self.direct[i], slots, self.direct[i].hidden,
                                                  self.top_k, pool, self.defer_order)
            if self.host:
                self.placed[True, i] = PlacementLink(self.host[i], slots, self.host[i].hidden,
                                                     self.top_k, pool, self.defer_order)

    def _link(self, i: int) -> Link:
        if self.streamer is not None and self.streaming and not (self.decoding and self.host):
            return self.streamer.links[i]
        host = self.decoding and bool(self.host)
        placed = self.placed.get((host, i))
        if placed is not None:
            return placed
        return self.host[i] if host else self.direct[i]

    def streaming_refusal(self) -> str:
        """Why prefill cannot stream these experts to the GPU now ("" if it can: a GPU, packed
        experts, room to stage at least one expert per layer; "" once the streamer is made)."""
        if not self.host:
            return "no GPU"
        if self.streamer is not None:
            return ""
        cap, staged, room = self._stream_room()
        return streaming_refusal(self.cpu, cap, staged, room)

    def stream_cap(self) -> int:
        """Misses per layer a streamed pass may copy (the streamer's staging, made or to be
        made now: engine/placement/staging_plan.py)."""
        if self.streamer is not None:
            return self.streamer.cap
        return self._stream_room()[0] if self.host else 0

    def _stream_room(self) -> tuple[int, int, int]:
        """(cap, GPU bytes of one staged expert, bytes free for experts) for a streamer made now:
        the placement's planned staging while free memory holds it, else a whole layer within
        the room (`staging_plan.streamer_cap`)."""
        free, total = (int(b) for b in torch.cuda.mem_get_info(self.device))
        room = auto_budget(free, total, 0)
        staging = self.placement.plan.staging if self.placement is not None else None
        staged = staged_expert_bytes(self.cpu, self.device)
        planned = staging.experts if staging is not None else None
        return streamer_cap(planned, self.cpu[0].num_experts, staged, free, room), staged, room

    def make_streamer(self) -> LayerStreamer:
        """The streamer, made at the first GPU prefill (the experts' host memory registered),
        its staging capped by `stream_cap` on a GPU; a split pass starts the host links' flag
        jobs (`pending`: `finish_step` or `abort_step` after the pass)."""
        if self.streamer is None:
            cap = self.stream_cap() if self.host else None
            self.streamer = LayerStreamer(self.cpu, self.device, self.act_quant, cap,
                                          self.host)
        return self.streamer

    @contextmanager
    def streamed(self, tokens: int, gpu_experts: int | None = None) -> Iterator[None]:
        """A prefill pass of `tokens` tokens whose routed experts run on the GPU: the resident
        ones (`place`) from their slots, the misses streamed layer by layer; with `gpu_experts`
        below a layer's misses only the first that many of them, the rest on the CPU at the
        same time (`LayerStreamer.begin`). The streamer is made and the experts' host memory
        registered at the first such pass."""
        streamer = self.make_streamer()
        self.streaming = True
        slots = self.placement.layers if self.placement is not None else None
        streamer.begin(tokens, self.top_k, gpu_experts, slots)
        try:
            yield
        finally:
            self.streaming = False

    def _queue(self, link: HostLink, deferred: int) -> None:
        """Submits `link`'s flag-gated CPU job (with `deferred` chained slots) now, or records it
        while a graph is captured."""
        if torch.cuda.is_current_stream_capturing():
            if self.recorded is None:
                raise RuntimeError("MoEOverlap: a CUDA graph is being captured outside "
                                   "begin_capture() / end_capture()")
            self.recorded.append((link, deferred))
        else:
            self.pending.append((link, link.submit(deferred)))

    def begin_capture(self) -> None:
        """Starts recording the flag jobs of the step about to be captured."""
        self.recorded = []

    def end_capture(self) -> list[tuple[HostLink, int]]:
        """The flag jobs the captured step starts, in stream order (for `submit_recorded`).

        RuntimeError when they exceed the pool's queue: a step queues them all at once,
        and a full queue would wait for a job that waits for the replay."""
        from hetmoe import _cpu  # the C++ extension may be absent (cpu_backend.unavailable)

        recorded, self.recorded = self.recorded or [], None
        capacity = int(_cpu.POOL_QUEUE_CAPACITY)
        if len(recorded) > capacity:
            raise RuntimeError(
                f"MoEOverlap: a decode step starts {len(recorded)} CPU jobs ({len(self.layers)} "
                f"MoE layers, deferred={self.deferred}) but the CPU pool queues {capacity}; "
                "use a smaller deferred")
        return recorded

    def submit_recorded(self, jobs: Sequence[tuple[HostLink, int]]) -> None:
        """Queues a captured step's CPU jobs (link, deferred) in stream order; call right after
        launching its replay (a job whose ready word is already set starts at once)."""
        self.pending.extend((link, link.submit(deferred)) for link, deferred in jobs)

    def take_pending(self) -> list[tuple[HostLink, int]]:
        """The flag jobs submitted since the last call (one step's, for `finish_step`)."""
        pending, self.pending = self.pending, []
        return pending

    def finish_step(self, pending: list[tuple[HostLink, int]] | None = None) -> None:
        """Once the step's stream work is done: waits its CPU jobs (`pending`, by default every
        job submitted since the last `take_pending`); RuntimeError with the first error one of
        them hit."""
        if pending is None:
            pending = self.take_pending()
        first = ""
        for link, handle in pending:
            try:
                link.moe.wait_flagged(handle)
            except (RuntimeError, ValueError) as exc:
                first = first or f"CPU experts of MoE layer {self.host.index(link)}: {exc}"
        if first:
            raise RuntimeError(first)

    def abort_step(self, inflight: Sequence[tuple[HostLink, int]] = ()) -> None:
        """Tears down a step that raised (and the `inflight` jobs of steps launched before it,
        taken with `take_pending`): the queued CPU jobs return without computing, a stream still
        waiting on a done word is let through, then every word is cleared."""
        jobs, self.pending = [*inflight, *self.pending], []
        if not self.host:
            return
        for link in self.host:
            link.flags.abort()
        for link, handle in jobs:
            try:
                link.moe.wait_flagged(handle)
            except (RuntimeError, ValueError):
                pass  # the step already failed: the error being raised is the one to report
        stream = torch.cuda.current_stream(self.device)
        deadline = time.monotonic() + ABORT_TIMEOUT_S
        while not stream.query():
            for link in self.host:
                link.flags.release_done()
                link.flags_late.release_done()
            if time.monotonic() > deadline:
                raise RuntimeError(f"MoEOverlap: the failed step's CUDA stream did not finish "
                                   f"within {ABORT_TIMEOUT_S:.0f} s")
            time.sleep(1e-4)
        for link in self.host:
            link.flags.reset()
            link.flags_late.reset()
