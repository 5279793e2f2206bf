"""CPU/GPU overlap of the routed experts, with Expert Deferral: the whole story in one place.

Per MoE layer k, in stream order (`MoEOverlap.forward`):

    router on the GPU -> ids/weights (+ x) to the layer's CPU buffers -> CPU submit
    shared experts on the GPU meanwhile
    CPU wait -> routed output to the GPU
    decode with deferral: CPU submit of layer k's lowest-scored experts (their ids replace the
    immediate ones in the same buffer); they run while the GPU does layer k+1's attention
    out = routed + (deferred output of layer k-1) + shared

Two transports move data and start/await CPU work (`Link`):
- `HostLink` (CUDA decode): fixed pinned buffers per layer, async copies, and the CPU backend's C
  submit/wait functions enqueued with `cudaLaunchHostFunc`, so the sequence is pure stream work
  and a CUDA graph can capture it (host nodes).
- `DirectLink` (prefill, and every step without a GPU): copies to CPU tensors, then the
  backend's `submit` / `sync` from Python; the shared experts still run between them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from hetmoe.experts.cpu_moe import CpuMoE, HostFunctions
from hetmoe.ops.deferral import check_deferred, moe_layers, split_ids


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


@functools.cache
def _launch_host_func() -> Any:
    """`cudaLaunchHostFunc` of the CUDA runtime torch loaded (the one the C++ side binds to)."""
    from hetmoe import _cpu

    torch.cuda.init()
    path = _cpu.cuda_runtime_path()
    if not path:
        raise RuntimeError("no CUDA runtime with cudaLaunchHostFunc is loaded in this process")
    fn = ctypes.CDLL(path).cudaLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class HostLink:
    """Pinned per-layer buffers [max_rows, ...] and stream-ordered host functions (graph-safe)."""

    def __init__(self, moe: CpuMoE, max_rows: int, top_k: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.moe, self.device = moe, device
        h = moe.hidden
        self.x = torch.zeros(max_rows, h, dtype=dtype, pin_memory=True)
        self.ids = torch.full((max_rows, top_k), -1, dtype=torch.int64, pin_memory=True)
        self.weights = torch.zeros(max_rows, top_k, dtype=torch.float32, pin_memory=True)
        self.out = torch.zeros(max_rows, h, dtype=dtype, pin_memory=True)
        self.rows = 0
        self.fns: HostFunctions | None = None

    def bind(self, rows: int) -> None:
        """Points the backend's host functions at the first `rows` rows of the buffers."""
        if rows != self.rows:
            self.fns = self.moe.host_functions(self.x[:rows], self.ids[:rows],
                                               self.weights[:rows], self.out[:rows])
            self.rows = rows

    def _launch(self, fn: int) -> None:
        assert self.fns is not None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        code = _launch_host_func()(stream, fn, self.fns.user_data)
        if code:
            raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {code}")

    def start(self, x: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor) -> None:
        t = ids.shape[0]
        self.bind(t)
        assert self.fns is not None
        if x is not None:
            self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        self.weights[:t].copy_(weights, non_blocking=True)
        self._launch(self.fns.submit_fn)

    def finish(self) -> torch.Tensor:
        assert self.fns is not None
        self._launch(self.fns.wait_fn)
        return self.out[: self.rows].to(self.device, non_blocking=True)


class MoEOverlap:
    """Runs every `HybridMoE` of a model through CPU/GPU overlap (see the module docstring).

    `deferred` applies inside `phase(decoding=True)` only; the graph runner keeps decode steps
    there. `trace`, when set, receives marks (`mark(label, layer)`) around each stage.
    """

    def __init__(self, model: nn.Module, device: torch.device, max_batch: int,
                 deferred: int = 0) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("MoEOverlap: the model has no hybrid_moe layer")
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.top_k = self.layers[0].gate.config.top_k
        check_deferred(deferred, self.top_k)
        self.deferred = deferred
        self.device = device
        cpu = [cpu_moe_of(m.experts) for m in self.layers]
        self.direct = [DirectLink(c) for c in cpu]
        self.host: list[HostLink] = []
        if device.type == "cuda":
            dtype = self.layers[0].gate.weight.dtype  # activations' dtype
            self.host = [HostLink(c, max_batch, self.top_k, dtype, device) for c in cpu]
        self.decoding = False
        self.trace: Any = None
        self._carry: Link | None = None  # layer k-1's deferred experts, in flight
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

    def check_host_errors(self) -> None:
        """RuntimeError with the first error a CPU host function kept since the last check."""
        for i, link in enumerate(self.host):
            message = link.moe.take_host_error()
            if message:
                raise RuntimeError(f"CPU experts of MoE layer {i}: {message}")

    def forward(self, moe: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE output (without the residual) of `hidden_states` [..., H] at layer `moe`."""
        shape = hidden_states.shape
        i = self.index[id(moe)]
        self._mark("moe_start", i)
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        ids, weights = moe.gate(x)  # [T, K] int64 sorted by score, [T, K] fp32
        host = self.decoding and bool(self.host)
        link: Link = self.host[i] if host else self.direct[i]
        d = self.deferred if self.decoding and i < len(self.layers) - 1 else 0
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
            out = out + self._carry.finish()
            self._mark("deferred_waited", i - 1)
        self._carry = link if late is not None else None
        if shared is not None:
            out = out + shared
        self._mark("moe_end", i)
        return out.reshape(shape)

    def _mark(self, label: str, layer: int) -> None:
        if self.trace is not None:
            self.trace.mark(label, layer)
