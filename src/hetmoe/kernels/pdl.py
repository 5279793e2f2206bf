"""Programmatic dependent launch (PDL): a decode step's small kernels start while the kernel
before them drains, instead of after it has finished and the GPU has launched the next one.

On compute capability 9.0+ a kernel launched with `launch_pdl=True` (`launch_args`) may begin
once every program of the kernel before it in the stream has called `start_next`
(griddepcontrol.launch_dependents) or exited; its programs then block in `wait_prior`
(griddepcontrol.wait) until that kernel has finished and its writes are visible. So each kernel
here calls `wait_prior` first, before any read or write (the previous kernel may still be writing
its inputs or reading its outputs' buffers), and `start_next` once its main loop is done. A kernel
launched without the flag (Inductor's, cuBLAS) waits as usual, and `wait_prior` returns at once
in a kernel that was not launched as a dependent: correctness never depends on the flag.

The decode step's kernels (norm_gemv, gemv_residual, gqa_decode, moe_router, the pair kernels)
take `PDL` as a constexpr and are launched through `launch_args(device)`. On only inside
`allowed(True)`, which the fused decode step opens where no layer has CPU work and every layer is
GQA (measured on an H100, docs/benchmarks/gpu_kernels.md round 10: every expert resident 296 ->
317 tok/s; every expert on the CPU 50.0 -> 44.2, so not there; MLA steps not measured); off
where Triton interprets (CPU tests), below compute capability 9.0, or with
HETMOE_DEPENDENT_LAUNCH=off (=always: the fused step allows them with CPU experts too, to
measure that case again).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

from hetmoe import env


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Block until the kernel launched before this one has finished and its writes are
    visible (a no-op without PDL or when this kernel was not launched as a dependent)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_next(PDL: tl.constexpr):
    """Let the next kernel in the stream begin launching (it still waits in `wait_prior` for
    this one to finish before touching memory)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


_ALLOWED: ContextVar[bool] = ContextVar("dependent_launch_allowed", default=False)


@contextlib.contextmanager
def allowed(flag: bool) -> Iterator[None]:
    """Kernels launched inside launch as programmatic dependents where `flag` and `supported`
    (outside any: never)."""
    token = _ALLOWED.set(flag)
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents: a CUDA GPU of compute
    capability 9.0+, compiled (not interpreted), HETMOE_DEPENDENT_LAUNCH not off."""
    if env.dependent_launch() == "off":
        return False
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    return _capability(device.index if device.index is not None else
                       torch.cuda.current_device()) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents here: `supported`, inside
    `allowed(True)`."""
    return _ALLOWED.get() and supported(device)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_args(device: torch.device) -> dict[str, bool]:
    """The keyword arguments of a PDL-aware kernel's launch on `device`: its `PDL` constexpr
    and, where on, Triton's `launch_pdl` launch option (the interpreter takes no such option)."""
    if enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
