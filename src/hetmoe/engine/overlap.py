"""CPU/GPU overlap of the routed experts, with Expert Deferral: the whole story in one place.

Per MoE layer k, in stream order (`MoEOverlap.forward`):

    router on the GPU -> ids/weights (+ x) to the layer's CPU buffers -> CPU start
    shared experts on the GPU meanwhile
    CPU wait -> routed output to the GPU
    decode with deferral: layer k's lowest-scored experts run on the CPU while the GPU does
    layer k+1's attention; with the flag signal the CPU job of layer k goes straight on to them
    (one start, a second done word), with host functions they are a second start
    out = routed + (deferred output of layer k-1) + shared

Two transports move data and start/await CPU work (`Link`):
- `HostLink` (CUDA decode, engine/host_link.py): fixed pinned buffers per layer, async copies,
  and start/wait in stream order (ready/done words in pinned memory by default, or CUDA host
  functions), so a CUDA graph can capture it. With the flag signal the step's CPU jobs wait in
  the pool for their ready words: `MoEOverlap` submits them as the step is launched (recorded
  at capture, queued as each replay is launched) and waits them in `finish_step`.
- `DirectLink` (prefill, and every step without a GPU): copies to CPU tensors, then the
  backend's `submit` / `sync` from Python; the shared experts still run between them.

`forward_packed` is the same story for the fused decode step (engine/fused_decode.py), whose
compiled layer function already routed and packed the CPU inputs into one vector: one copy per
start, and the caller adds the returned terms to the residual.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from hetmoe.engine.host_link import HostLink, Signal, check_signal
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.ops.deferral import check_deferred, moe_layers, split_ids
from hetmoe.ops.fused import unpack_moe_inputs

if TYPE_CHECKING:
    from hetmoe.ops.moe import HybridMoE

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


class Link(Protocol):
    """Moves one layer's inputs to its CPU experts, starts them, and brings the output back."""

    def start(self, x: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Submits the experts on x [T, H] (None: the x of the previous start)."""

    def finish(self) -> torch.Tensor:
        """Waits for the last start and returns its output [T, H] on the caller's device."""


class DirectLink:
    """Python-side submit/sync on CPU copies of the inputs (prefill; no GPU)."""

    def __init__(self, moe: CpuMoE) -> None:
        self.moe = moe
        self.x: torch.Tensor | None = None
        self.device = torch.device("cpu")
        self.call: Any = None

    def start(self, x: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if x is not None:
            self.device = x.device
            self.x = x.to("cpu").contiguous()
        assert self.x is not None
        self.call = self.moe.submit(self.x, ids.to("cpu").contiguous(),
                                    weights.to("cpu").contiguous())

    def finish(self) -> torch.Tensor:
        out, self.call = self.moe.sync(self.call), None
        return out.to(self.device)


class MoEOverlap:
    """Runs every `HybridMoE` of a model through CPU/GPU overlap (see the module docstring).

    `deferred` applies inside `phase(decoding=True)` only; the graph runner keeps decode steps
    there. `trace`, when set, receives marks (`mark(label, layer)`) around each stage.
    """

    def __init__(self, model: nn.Module, device: torch.device, max_batch: int,
                 deferred: int = 0, signal: Signal = "flags", packed: bool = False) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("MoEOverlap: the model has no hybrid_moe layer")
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.top_k = self.layers[0].gate.config.top_k
        check_deferred(deferred, self.top_k)
        check_signal(signal, device)
        self.deferred, self.device, self.signal = deferred, device, signal
        cpu = [cpu_moe_of(m.experts) for m in self.layers]
        self.direct = [DirectLink(c) for c in cpu]
        self.host: list[HostLink] = []
        if device.type == "cuda":
            dtype = self.layers[0].gate.weight.dtype  # activations' dtype
            self.host = [HostLink(c, max_batch, self.top_k, dtype, device, signal, self._queue,
                                  packed) for c in cpu]
        self.recorded: list[tuple[HostLink, int]] | None = None  # flag jobs (link, deferred)
        # of a step being captured
        self.pending: list[tuple[HostLink, int]] = []  # flag jobs submitted for this step
        self.decoding = False
        self.trace: Any = None
        self._carry: Callable[[], torch.Tensor] | None = None  # awaits layer k-1's deferred
        # experts (in flight)
        self.attach()

    def attach(self) -> None:
        """Routes every MoE layer's forward through this overlap (done at construction)."""
        for moe in self.layers:
            moe.runtime = self

    def detach(self) -> None:
        """Gives the MoE layers back their own forward (no overlap, no deferral)."""
        for moe in self.layers:
            moe.runtime = None

    @contextmanager
    def phase(self, decoding: bool) -> Iterator[None]:
        """Marks the forward passes inside as decode steps (deferral allowed) or prefill."""
        before, self.decoding = self.decoding, decoding
        self._carry = None  # a step that raised must not hand its deferred experts to the next
        try:
            yield
        finally:
            self.decoding = before

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
        from hetmoe import _cpu

        recorded, self.recorded = self.recorded or [], None
        capacity = int(_cpu.POOL_QUEUE_CAPACITY)
        if len(recorded) > capacity:
            raise RuntimeError(
                f"MoEOverlap: a decode step starts {len(recorded)} CPU jobs ({len(self.layers)} "
                f"MoE layers, deferred={self.deferred}) but the CPU pool queues {capacity}; "
                "use deferred=0 or signal='host_functions'")
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
        them (or a host function) hit."""
        if pending is None:
            pending = self.take_pending()
        first = ""
        for link, handle in pending:
            try:
                link.moe.wait_flagged(handle)
            except (RuntimeError, ValueError) as exc:
                first = first or f"CPU experts of MoE layer {self.host.index(link)}: {exc}"
        for i, link in enumerate(self.host):
            message = link.moe.take_host_error()
            if message and not first:
                first = f"CPU experts of MoE layer {i}: {message}"
        if first:
            raise RuntimeError(first)

    def abort_step(self, inflight: Sequence[tuple[HostLink, int]] = ()) -> None:
        """Tears down a step that raised (and the `inflight` jobs of steps launched before it,
        taken with `take_pending`): the queued CPU jobs return without computing, a stream still
        waiting on a done word is let through, then every word is cleared."""
        jobs, self.pending = [*inflight, *self.pending], []
        if self.signal != "flags" or not self.host:
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

    def deferred_at(self, i: int) -> int:
        """Experts per token MoE layer i defers: `deferred` in decode, 0 in prefill and at the
        last MoE layer."""
        return self.deferred if self.decoding and i < len(self.layers) - 1 else 0

    def chains_deferral(self) -> bool:
        """Whether a decode start computes the deferred experts too (`HostLink.chains`): its
        inputs then hold all K ids, not the immediate ones."""
        return self.decoding and bool(self.host) and self.host[0].chains

    def forward(self, moe: HybridMoE, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE output (without the residual) of `hidden_states` [..., H] at layer `moe`."""
        shape = hidden_states.shape
        i = self.index[id(moe)]
        self._mark("moe_start", i)
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        ids, weights = moe.gate(x)  # [T, K] int64 sorted by score, [T, K] fp32
        d = self.deferred_at(i)
        host = self.host[i] if self.decoding and self.host else None
        link: Link = host if host is not None else self.direct[i]
        late = None
        if host is not None and host.chains:
            host.start(x, ids, weights, deferred=d)  # the job goes on to the deferred slots
        else:
            immediate, late = split_ids(ids, d) if d else (ids, None)
            link.start(x, immediate, weights)
        self._mark("submitted", i)
        shared = moe._shared(x)  # GPU, while the CPU computes
        self._mark("shared_done", i)
        out = link.finish()
        self._mark("waited", i)
        if late is not None:
            link.start(None, late, weights)  # runs during layer i+1's attention
            self._mark("deferred_submitted", i)
        if self._carry is not None:
            out = out + self._carry()
            self._mark("deferred_waited", i - 1)
        self._carry = self._late_output(link, d)
        if shared is not None:
            out = out + shared
        self._mark("moe_end", i)
        return out.reshape(shape)

    def forward_packed(self, i: int, x: torch.Tensor, stage: torch.Tensor,
                       late: torch.Tensor | None,
                       shared: Callable[[], torch.Tensor | None]) -> list[torch.Tensor]:
        """MoE layer i of a fused decode step (engine/fused_decode.py), whose compiled layer
        already routed: `stage` = `pack_moe_inputs(x, ids, weights)` with all K ids when
        `chains_deferral()`, else the immediate ids and `late` the deferred ones [T, K] (or
        None). The same story as `forward`, one copy per start; returns the terms the caller
        adds to the residual: routed (fp32 when packed), the previous layer's deferred output,
        the shared experts' output."""
        rows = x.shape[0]
        d = self.deferred_at(i)
        self._mark("moe_start", i)
        if self.decoding and self.host:
            link: Link = self.host[i]
            chained = d if self.host[i].chains else 0
            self.host[i].start_packed(stage, rows, deferred=chained)
        else:  # no GPU: the same inputs through Python submit/sync
            link = self.direct[i]
            _, ids, weights = unpack_moe_inputs(stage, rows, x.shape[1], self.top_k)
            link.start(x, ids, weights)
        self._mark("submitted", i)
        out = shared()  # GPU, while the CPU computes
        self._mark("shared_done", i)
        terms = [link.finish()]
        self._mark("waited", i)
        if late is not None:
            if isinstance(link, HostLink):
                link.start_ids(late)  # runs during layer i+1's attention
            else:
                link.start(None, late, weights)
            self._mark("deferred_submitted", i)
        if self._carry is not None:
            terms.append(self._carry())
            self._mark("deferred_waited", i - 1)
        self._carry = self._late_output(link, d)
        if out is not None:
            terms.append(out)
        self._mark("moe_end", i)
        return terms

    @staticmethod
    def _late_output(link: Link, deferred: int) -> Callable[[], torch.Tensor] | None:
        """What awaits this layer's deferred experts at the next MoE layer (None: none)."""
        if not deferred:
            return None
        if isinstance(link, HostLink) and link.chains:
            return link.finish_late
        return link.finish

    def _mark(self, label: str, layer: int) -> None:
        if self.trace is not None:
            self.trace.mark(label, layer)
