"""Layer-wise GPU prefill: each MoE layer's routed experts streamed from the one packed host copy.

For a long prompt the routed experts run on the GPU instead of the CPU: the prompt passes the
layers in order, so each layer's packed experts cross PCIe once per pass, in their packed bytes
(INT8 half of BF16, INT4 a quarter), straight from the CPU backend's mappings (registered with
the CUDA driver, so the copy is DMA with no second host copy). Copies run on a stream of their
own into two GPU staging buffers: layer i+2 is copied into layer i's buffer as soon as layer i's
compute is done, so copies overlap compute and the pass is bound by PCIe, not by the GPU. A
layer's experts are computed on their packed bytes by the Triton kernels of kernels/packed_moe.py
(dequantized in registers), or, where those cannot run (or HETMOE_GPU_EXPERTS=unpack), unpacked
to bf16 (experts/packed_layout.py) and computed as a grouped GEMM (experts/routed_mlp.py).
`GpuLink` is the layer's `ops.moe_step.Link`.

A pass may *split* each layer (engine/expert_split.py): only its first k experts are copied (as
early as a whole layer would be) and computed on the GPU, while the CPU computes the others
(their ids, the rest masked to -1) at the same time; the activations cross to the host once the
router has run and the CPU's sum comes back to be added. Layers kept resident on the GPU (a
budget in bytes, the first layers first) are never copied and run wholly on the GPU.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from hetmoe import env
from hetmoe.experts.cpu_moe import CpuMoE, PendingCall
from hetmoe.experts.gpu_view import gpu_view
from hetmoe.experts.packed_layout import host_tensor, unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp
from hetmoe.kernels.packed_moe import packed_moe, unsupported

log = logging.getLogger(__name__)

STREAM_FORMATS = ("bf16", "int8", "int4", "fp8")
"""Packed formats GPU prefill unpacks."""


_PINNED: weakref.WeakKeyDictionary[CpuMoE, list[torch.Tensor]] = weakref.WeakKeyDictionary()
"""Each layer's registered mappings as host tensors; unregistered when its `CpuMoE` goes (before
the memory is unmapped, so a later mapping at the same address can be registered again)."""


_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def pinned_groups(moe: CpuMoE) -> list[torch.Tensor]:
    """`moe`'s packed group mappings as uint8 host tensors, registered with the CUDA driver as
    pinned memory (once per layer, shared by every streamer) so copies from them are DMA."""
    known = _PINNED.get(moe)
    if known is not None:
        return known
    cudart = torch.cuda.cudart()
    tensors: list[torch.Tensor] = []
    addresses: list[int] = []
    for part in moe.packed_groups():
        # A converted model's layer file is mapped read-only: the driver must not ask to write.
        flags = _REGISTER_READ_ONLY if part.read_only else 0
        code = int(cudart.cudaHostRegister(part.address, part.bytes, flags))
        if code != 0:
            _unregister(addresses)
            raise RuntimeError(f"GPU prefill: cudaHostRegister of {part.bytes} bytes of packed "
                               f"experts failed with CUDA error {code}")
        addresses.append(part.address)
        tensors.append(host_tensor(part))
    weakref.finalize(moe, _unregister, addresses)
    _PINNED[moe] = tensors
    return tensors


def _unregister(addresses: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def streaming_bytes(cpu: Sequence[CpuMoE], resident_bytes: int = 0) -> int:
    """GPU bytes a streamed pass needs beyond activations: two staging buffers of the largest
    layer's packed experts, that layer unpacked to bf16 (gate/up and down), and the packed
    experts kept resident (at most `resident_bytes`)."""
    staging = max(sum(p.bytes for p in m.packed_groups()) for m in cpu)
    unpacked = max(m.num_experts * 3 * m.hidden * m.intermediate * 2 for m in cpu)
    return 2 * staging + unpacked + resident_bytes


def streaming_refusal(cpu: Sequence[CpuMoE], free_bytes: int, resident_bytes: int = 0) -> str:
    """Why prefill cannot stream these experts to a GPU with `free_bytes` free ("" if it can)."""
    formats = {m.weight_format for m in cpu}
    if not formats <= set(STREAM_FORMATS):
        return (f"GPU prefill unpacks {', '.join(STREAM_FORMATS)} experts, not "
                f"{', '.join(sorted(formats - set(STREAM_FORMATS)))}")
    need = streaming_bytes(cpu, resident_bytes)
    if need > 0.8 * free_bytes:  # the rest is the pass's activations
        return (f"GPU prefill needs {need / 2**30:.1f} GiB of GPU memory for one layer's "
                f"experts (staged twice and unpacked) and {resident_bytes / 2**30:.1f} GiB "
                f"kept resident, {free_bytes / 2**30:.1f} GiB are free")
    return ""


class LayerStreamer:
    """Staging buffers, the copy stream and the per-layer copies of a model's MoE layers;
    `resident_bytes`: the first layers that fit in it keep their packed experts on the GPU."""

    def __init__(self, cpu: Sequence[CpuMoE], device: torch.device,
                 resident_bytes: int = 0) -> None:
        if any(m.weight_format not in STREAM_FORMATS for m in cpu):
            raise ValueError(streaming_refusal(cpu, 2**62))
        self.cpu, self.device = list(cpu), device
        self.parts = [m.packed_groups() for m in cpu]
        self.host = [pinned_groups(m) for m in cpu]
        self.layer_bytes = [sum(p.bytes for p in parts) for parts in self.parts]
        self.num_experts = cpu[0].num_experts
        self.gpu_experts = self.num_experts  # of each layer, this pass (`begin`)
        with torch.inference_mode(False):  # written in place by every pass, in or out of it
            self.resident: list[torch.Tensor | None] = []
            left = resident_bytes
            for i, size in enumerate(self.layer_bytes):
                fits = size <= left and (i == 0 or self.resident[-1] is not None)
                self.resident.append(self._upload(i) if fits else None)
                left -= size if fits else 0
            size = max((b for b, r in zip(self.layer_bytes, self.resident, strict=True)
                        if r is None), default=0)
            self.staging = [torch.empty(size, dtype=torch.uint8, device=device)
                            for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in cpu]  # layer i's experts are on the GPU
        self.freed = [torch.cuda.Event() for _ in range(2)]  # a buffer's layer is computed
        self.grouped = grouped_mm_available(device)
        why = unsupported(device, cpu[0].weight_format)
        self.packed_kernel = not why and env.gpu_expert_kernel() == "packed"
        if why:
            log.info("GPU prefill unpacks experts to bf16: %s", why)
        self.links = [GpuLink(self, i) for i in range(len(cpu))]
        self._local: torch.Tensor | None = None  # [E]: expert -> GPU index (split), -1: CPU
        self._host_in: tuple[torch.Tensor, ...] = ()  # pinned x, ids, weights, out (split;
        # kept across passes, made again when a pass has more rows, another dtype or top-k)
        self._out_view = torch.empty(0)  # the pinned out as a GPU tensor (`gpu_view`)
        log.info("GPU prefill: %d layers, %.2f GB of packed experts per pass (%d layers "
                 "resident), %s", len(cpu), sum(self.layer_bytes) / 1e9, self.resident_layers(),
                 "packed kernels" if self.packed_kernel
                 else "unpack + grouped GEMM" if self.grouped else "unpack, per expert")

    def _upload(self, i: int) -> torch.Tensor:
        """Layer i's packed experts copied to the GPU for good (groups side by side)."""
        out = torch.empty(self.layer_bytes[i], dtype=torch.uint8, device=self.device)
        at = 0
        for host in self.host[i]:
            out[at:at + host.numel()].copy_(host)
            at += host.numel()
        return out

    def resident_layers(self) -> int:
        """How many layers keep their packed experts on the GPU."""
        return sum(r is not None for r in self.resident)

    def bytes_per_pass(self) -> int:
        """Packed expert bytes a pass that streams every expert moves to the GPU."""
        return sum(b for b, r in zip(self.layer_bytes, self.resident, strict=True) if r is None)

    def begin(self, tokens: int, top_k: int, gpu_experts: int | None = None) -> None:
        """Starts a pass of `tokens` tokens routed to `top_k` experts each, the first
        `gpu_experts` experts of each layer on the GPU (None: all) and the rest on the CPU;
        queues the first two layers' copies."""
        k = self.num_experts if gpu_experts is None else gpu_experts
        if not 0 < k <= self.num_experts:
            raise ValueError(f"gpu_experts must be in [1, {self.num_experts}], got {k}")
        self.gpu_experts = k
        self._local = None
        if k < self.num_experts:
            experts = torch.arange(self.num_experts)
            self._local = torch.where(experts < k, experts, -1).to(self.device)
        for i in range(min(2, len(self.cpu))):
            self._copy(i)

    def _experts_here(self, i: int) -> int:
        """How many experts (the first) layer i computes on the GPU in this pass."""
        return self.num_experts if self.resident[i] is not None else self.gpu_experts

    def _copy(self, i: int) -> None:
        """Copies layer i's first `_experts_here(i)` experts of each group, side by side, into
        buffer i % 2 on the copy stream, after that buffer's last use (a resident layer: none)."""
        if self.resident[i] is not None:
            return
        buffer, count = self.staging[i % 2], self._experts_here(i)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[i % 2])
            at = 0
            for part, host in zip(self.parts[i], self.host[i], strict=True):
                n = count * part.expert_bytes
                buffer[at:at + n].copy_(host[:n], non_blocking=True)
                at += n
            self.copied[i].record(self.copy_stream)

    def unpacked(self, i: int, experts: int | None = None) -> list[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
        """Layer i's experts on the GPU (its staging buffer, copied there, or its resident
        copy), per NUMA group (gate_up, down) in bf16 (`packed_layout.unpack_group`);
        `experts`: only the first that many of each group (packed side by side)."""
        moe, at = self.cpu[i], 0
        resident = self.resident[i]
        buffer = resident if resident is not None else self.staging[i % 2]
        count = moe.num_experts if experts is None else experts
        groups = []
        for part in self.parts[i]:
            raw = buffer[at:at + count * part.expert_bytes].view(count, part.expert_bytes)
            groups.append(unpack_group(raw, part, moe.weight_format, moe.hidden,
                                       moe.group_size))
            at += (count if resident is None else moe.num_experts) * part.expert_bytes
        return groups

    def computed(self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 experts: int | None = None) -> torch.Tensor:
        """Layer i's routed output [T, H] (x's dtype) from the packed kernels, each NUMA group's
        slice summed; ids index the first `experts` experts of each group (-1: skip)."""
        moe, at, total, resident = self.cpu[i], 0, None, self.resident[i]
        buffer = resident if resident is not None else self.staging[i % 2]
        count = moe.num_experts if experts is None else experts
        for part in self.parts[i]:
            raw = buffer[at:at + count * part.expert_bytes]
            out = packed_moe(x, ids, weights, raw, part, moe.weight_format, moe.hidden,
                             moe.group_size)
            total = out if total is None else total + out
            at += (count if resident is None else moe.num_experts) * part.expert_bytes
        assert total is not None
        return total.to(x.dtype)

    def start(self, i: int, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts layer i's routed experts on x [T, H]: the CPU's share (a split layer) at
        once, the GPU's queued on the current stream after its copy, then the copy of layer
        i + 2 into the freed buffer. The returned function (called after whatever the caller
        queues meanwhile, e.g. the shared experts) waits for the CPU and returns the layer's
        routed output [T, H]."""
        stream = torch.cuda.current_stream(self.device)
        k = self._experts_here(i)
        call = self._start_cpu(i, x, ids, weights, stream) if k < self.num_experts else None
        stream.wait_event(self.copied[i])
        if self.packed_kernel:
            here = torch.where(ids < k, ids, -1) if call is not None else ids
            out = self.computed(i, x, here, weights, k)
        else:
            local = self._local if call is not None else None
            out = routed_mlp(x, ids, weights, self.unpacked(i, k), self.grouped, local)
        self.freed[i % 2].record(stream)
        if i + 2 < len(self.cpu):
            self._copy(i + 2)
        if call is None:
            return lambda: out

        def finish() -> torch.Tensor:
            self.cpu[i].sync(call)
            # Read in place over PCIe by the add itself: a copy would queue on the copy engine
            # behind the next layers' expert copies.
            t = x.shape[0]
            return out + self._out_view[:t].to(out.dtype)

        return finish

    def _start_cpu(self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   stream: torch.cuda.Stream) -> PendingCall:
        """Submits the CPU's share of layer i (experts >= k; the others' ids -1) once the
        router's output has reached the host (pinned buffers, reused by every layer: the
        previous layer's CPU call is synced and its output copied before this copy)."""
        t, top_k = ids.shape
        dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
        if (not self._host_in or self._host_in[0].shape[0] < t
                or self._host_in[0].dtype != dtype or self._host_in[1].shape[1] != top_k):
            self._host_in = (
                torch.empty(t, x.shape[1], dtype=dtype, pin_memory=True),
                torch.empty(t, top_k, dtype=torch.int64, pin_memory=True),
                torch.empty(t, top_k, dtype=torch.float32, pin_memory=True),
                torch.empty(t, x.shape[1], dtype=dtype, pin_memory=True))
            self._out_view = gpu_view(self._host_in[3], self.device)
        host_x, host_ids, host_w, host_out = (b[:t] for b in self._host_in)
        k = self.gpu_experts
        with torch.cuda.stream(stream):
            host_x.copy_(x, non_blocking=True)
            host_ids.copy_(torch.where(ids >= k, ids, -1), non_blocking=True)
            host_w.copy_(weights, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)  # sleeps: the pool needs the cores
        ready.record(stream)
        ready.synchronize()
        return self.cpu[i].submit(host_x, host_ids, host_w, host_out)


class GpuLink:
    """`ops.moe_step.Link` of MoE layer i in a GPU prefill pass (no deferral in prefill)."""

    def __init__(self, streamer: LayerStreamer, i: int) -> None:
        self.streamer, self.i = streamer, i
        self.pending: Callable[[], torch.Tensor] | None = None

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        if deferred:
            raise ValueError("GPU prefill does not defer experts")
        self.pending = self.streamer.start(self.i, x, ids, weights)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        raise RuntimeError("GPU prefill runs the HF layers, not the fused decode step")

    def finish(self) -> torch.Tensor:
        if self.pending is None:
            raise RuntimeError("GpuLink.finish without start")
        pending, self.pending = self.pending, None
        return pending()

    def finish_late(self) -> torch.Tensor:
        raise RuntimeError("GPU prefill does not defer experts")
