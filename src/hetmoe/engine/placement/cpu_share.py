"""The CPU's share of a split layer in a GPU prefill pass (engine/placement/layer_stream.py).

On a GPU the share starts and is awaited in stream order through the layer's `HostLink` words,
as the decode path does: after the router the stream copies the activations, ids and weights to
pinned memory and sets the ready word, the CPU job queued ahead spins on it, and the stream waits
for the done word before the add that reads the CPU's sum in place. The host never waits, so it
queues the next layers while the GPU and the CPU work, and no host wake-up or Python launch sits
between a layer's router and its CPU experts. Up to the link's rows (a decode step streamed) its
own buffers carry them; a longer pass shares one set of pinned buffers across its layers (in
stream order a layer's job is done before the next layer's inputs are copied). Without host
links (the CPU device, tests) the share is submitted once the router's output is on the host
and synced by the returned function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from hetmoe.experts.cpu_moe import CpuMoE, PendingCall
from hetmoe.experts.gpu_view import gpu_view


class HostSide(Protocol):
    """What a split layer uses of its `HostLink` (engine/executor/host_link.py, which imports
    this room): the CPU experts started in stream order on pinned inputs (its own, or wider
    ones), and the pinned output [max_rows, H] whose done word the stream awaits
    (`flags.wait_done_on`)."""

    out: torch.Tensor
    flags: Any  # _cpu.StreamFlags

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None: ...

    def start_wide(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   buffers: tuple[torch.Tensor, ...]) -> None: ...


class CpuShare:
    """Starts the CPU's share of a model's split layers (see the module docstring); `host`:
    each layer's `HostLink` on a GPU (none: every share host-synced)."""

    def __init__(self, cpu: Sequence[CpuMoE], device: torch.device,
                 host: Sequence[HostSide] = ()) -> None:
        self.cpu, self.device = list(cpu), device
        self.cuda = device.type == "cuda"
        self.links = list(host) if self.cuda else []
        self.host_waits = 0  # shares the host waited to start (the streamer's `begin` clears)
        self._buffers: tuple[torch.Tensor, ...] = ()  # pinned x, ids, weights, out (kept
        # across passes, made again when a pass has more rows, another dtype or top-k)
        self._out_view = torch.empty(0)  # the shared out as a GPU tensor (`gpu_view`)
        self._views: dict[int, torch.Tensor] = {}  # layer -> its link's out on the GPU

    def start(self, i: int, x: torch.Tensor, cpu_ids: torch.Tensor, weights: torch.Tensor,
              stream: torch.cuda.Stream | None) -> Callable[[], torch.Tensor]:
        """Starts layer i's CPU experts on x [T, H] (`cpu_ids` [T, K], the others -1); the
        returned function waits for them (in stream order on a GPU) and gives their sum [T, H]
        as the GPU reads it."""
        t = x.shape[0]
        if stream is None or not self.links:
            self.host_waits += 1
            call = self._start_synced(i, x, cpu_ids, weights, stream)
            return lambda: (self.cpu[i].sync(call), self._out_view[:t])[1]
        link = self.links[i]
        if t <= link.out.shape[0]:
            link.start(x, cpu_ids, weights)  # copies, ready word, the job queued (MoEOverlap)
            view = self._views.get(i)
            if view is None:
                view = self._views[i] = gpu_view(link.out, self.device)
        else:
            link.start_wide(x, cpu_ids, weights, self.buffers(x, cpu_ids.shape[1]))
            view = self._out_view
        ptr = int(stream.cuda_stream)

        def wait() -> torch.Tensor:
            link.flags.wait_done_on(ptr)  # in stream order: the host goes on
            return view[:t]

        return wait

    def buffers(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
        """Pinned (on a GPU) x, ids, weights and out of at least x's rows; fp16 activations
        cross as fp32. Made again for more rows, another dtype or top-k: a pass that may still
        read the old ones has ended (the planner's `run_pass` syncs its stream at its end)."""
        t = x.shape[0]
        dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
        held = self._buffers
        if not held or held[0].shape[0] < t or held[0].dtype != dtype or held[1].shape[1] != top_k:
            pin = self.cuda
            self._buffers = (
                torch.empty(t, x.shape[1], dtype=dtype, pin_memory=pin),
                torch.empty(t, top_k, dtype=torch.int64, pin_memory=pin),
                torch.empty(t, top_k, dtype=torch.float32, pin_memory=pin),
                torch.empty(t, x.shape[1], dtype=dtype, pin_memory=pin))
            out = self._buffers[3]
            self._out_view = gpu_view(out, self.device) if self.cuda else out
        return self._buffers

    def _start_synced(self, i: int, x: torch.Tensor, cpu_ids: torch.Tensor,
                      weights: torch.Tensor, stream: torch.cuda.Stream | None) -> PendingCall:
        """Submits layer i's share once the router's output has reached the host (the shared
        buffers: the previous layer's call is synced and its output read before this copy)."""
        host_x, host_ids, host_w, host_out = (
            b[:x.shape[0]] for b in self.buffers(x, cpu_ids.shape[1]))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            host_x.copy_(x, non_blocking=True)
            host_ids.copy_(cpu_ids, non_blocking=True)
            host_w.copy_(weights, non_blocking=True)
        if stream is not None:
            ready = torch.cuda.Event(blocking=True)  # sleeps: the pool needs the cores
            ready.record(stream)
            ready.synchronize()
        return self.cpu[i].submit(host_x, host_ids, host_w, host_out)
