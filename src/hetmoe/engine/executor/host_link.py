"""`HostLink`: one MoE layer's CUDA decode transport to its CPU experts (graph-safe).

Fixed pinned buffers [max_rows, ...] and async copies; the CPU work is started and awaited in
stream order, so a CUDA graph can capture the whole sequence: after the input copies the stream
sets a *ready* word in pinned memory, and before the output copy it waits for a *done* word (the
CUDA driver's stream memory operations, captured as memop nodes). The CPU job is queued in the
pool ahead of time and spins on its ready word (`_cpu.StreamFlags`, protocol in
csrc/runtime/stream_flags.h): no thread has to wake up on the critical path. With Expert Deferral
the same job goes on to the layer's deferred experts into a second output buffer and sets a
second done word, which the stream awaits at the next MoE layer: the deferred experts start with
no round trip through the GPU. Implements `ops.moe_step.Link`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.ops.fused import staged_words, unpack_moe_inputs

# `hetmoe._cpu` is imported inside the functions that call it: the C++ extension may be absent
# (experts/cpu_backend.py `unavailable` says so by name), and this module loads without it.


def check_stream_memops(device: torch.device) -> None:
    """RuntimeError when this process's CUDA driver lacks stream memory operations (every Linux
    driver since CUDA 12 has them enabled; hetmoe's GPU decode needs them)."""
    if device.type != "cuda":
        return
    from hetmoe import _cpu

    torch.cuda.init()
    if not _cpu.stream_memops_available():
        raise RuntimeError(
            "GPU decode with CPU experts needs the CUDA driver's stream memory operations "
            "(cuStreamWriteValue32 in libcuda), which this process has not loaded; update the "
            "NVIDIA driver, or run with device='cpu'"
        )


class HostLink:
    """Pinned per-layer buffers and stream-ordered CPU start/wait (see the module docstring).

    `start` enqueues the ready word and hands the link and its deferred slot count to `queue`,
    which submits the flag-gated CPU job (or records it while a CUDA graph is being captured);
    `finish_late` awaits the deferred slots. With `packed=True` the inputs live in one pinned
    int32 vector laid out as `ops.fused.pack_moe_inputs` writes it for the bound row count (x as
    fp32, ids, weights), so `start_packed` moves them with ONE copy.
    """

    def __init__(self, moe: CpuMoE, max_rows: int, top_k: int, dtype: torch.dtype,
                 device: torch.device, queue: Callable[[HostLink, int], None],
                 packed: bool = False) -> None:
        from hetmoe import _cpu

        self.moe, self.device = moe, device
        h = moe.hidden
        self.hidden, self.top_k, self.packed = h, top_k, packed
        self.stage = torch.zeros(staged_words(max_rows, h, top_k) if packed else 0,
                                 dtype=torch.int32, pin_memory=True)
        self.x = torch.zeros(0 if packed else max_rows, h, dtype=dtype, pin_memory=True)
        self.ids = torch.full((0 if packed else max_rows, top_k), -1, dtype=torch.int64,
                              pin_memory=True)
        self.weights = torch.zeros(0 if packed else max_rows, top_k, dtype=torch.float32,
                                   pin_memory=True)
        # The CPU backend writes out in x's dtype: fp32 when packed.
        out_dtype = torch.float32 if packed else dtype
        self.out = torch.zeros(max_rows, h, dtype=out_dtype, pin_memory=True)
        self.out_late = torch.zeros(max_rows, h, dtype=out_dtype, pin_memory=True)
        self.rows = 0
        self.queue = queue
        # The ready, done and deferred-done words on 64-byte lines of their own: [3, 16] int32,
        # [:, 0] used.
        self.words = torch.zeros(3, 16, dtype=torch.int32, pin_memory=True)
        self.flags = _cpu.StreamFlags(self.words[0].data_ptr(), self.words[1].data_ptr())
        self.flags_late = _cpu.StreamFlags(self.words[0].data_ptr(), self.words[2].data_ptr())

    def bind(self, rows: int) -> None:
        """Points the backend's CPU calls at the first `rows` rows of the buffers."""
        if rows != self.rows:
            if self.packed:
                self.x, self.ids, self.weights = unpack_moe_inputs(self.stage, rows, self.hidden,
                                                                   self.top_k)
            self.moe.bind(self.x[:rows], self.ids[:rows], self.weights[:rows], self.out[:rows])
            self.rows = rows

    def submit(self, deferred: int = 0) -> int:
        """Queues the flag-gated CPU job of the bound rows (its last `deferred` slots into
        `out_late`); the pool handle."""
        if not deferred:
            return self.moe.submit_flagged(self.flags)
        return self.moe.submit_flagged(self.flags, deferred, self.flags_late,
                                       self.out_late[: self.rows])

    def _stream(self) -> int:
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        """Copies the inputs and starts the CPU experts on them (the last `deferred` slots go
        to `finish_late`)."""
        t = ids.shape[0]
        self.bind(t)
        self.x[:t].copy_(x, non_blocking=True)
        self.ids[:t].copy_(ids, non_blocking=True)
        self.weights[:t].copy_(weights, non_blocking=True)
        self._signal_start(deferred)

    def start_wide(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   buffers: tuple[torch.Tensor, ...]) -> None:
        """`start` on more rows than this link's buffers hold, in `buffers` (pinned x, ids,
        weights, out of at least T rows, shared by a prefill pass's layers: in stream order a
        layer's job is done before the next layer's inputs are copied); the next `bind` binds
        the link's own buffers again."""
        t = ids.shape[0]
        host_x, host_ids, host_w, host_out = (b[:t] for b in buffers)
        self.moe.bind(host_x, host_ids, host_w, host_out)
        self.rows = 0
        host_x.copy_(x, non_blocking=True)
        host_ids.copy_(ids, non_blocking=True)
        host_w.copy_(weights, non_blocking=True)
        self._signal_start(0)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        """Starts the CPU experts on a `pack_moe_inputs` vector of `rows` tokens: one copy."""
        if not self.packed:
            raise RuntimeError("HostLink.start_packed needs a link built with packed=True")
        self.bind(rows)
        self.stage[:stage.numel()].copy_(stage, non_blocking=True)
        self._signal_start(deferred)

    def _signal_start(self, deferred: int) -> None:
        self.flags.signal_ready_on(self._stream())
        self.queue(self, deferred)

    def finish(self) -> torch.Tensor:
        """Waits (in stream order) for the last start; its output [T, H] on the GPU."""
        self.flags.wait_done_on(self._stream())
        return self.out[: self.rows].to(self.device, non_blocking=True)

    def finish_late(self) -> torch.Tensor:
        """Waits (in stream order) for the deferred slots of the last start; their output
        [T, H] on the GPU."""
        self.flags_late.wait_done_on(self._stream())
        return self.out_late[: self.rows].to(self.device, non_blocking=True)
