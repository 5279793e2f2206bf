"""Layer-wise GPU prefill: each MoE layer's routed experts streamed from the one packed host copy.

For a long prompt the routed experts run on the GPU instead of the CPU: the prompt passes the
layers in order, so each layer's packed experts cross PCIe once per pass, in their packed bytes
(INT8 half of BF16, INT4 a quarter), straight from the CPU backend's mappings (registered with
the CUDA driver, so the copy is DMA with no second host copy). Copies run on a stream of their
own into two GPU staging buffers: layer i+2 is copied into layer i's buffer as soon as layer i's
compute is done, so copies overlap compute and the pass is bound by PCIe, not by the GPU. A
layer's experts are unpacked on the GPU (experts/packed_layout.py) and computed as a grouped
GEMM over the rows routed to each expert (experts/routed_mlp.py). `GpuLink` is the layer's
`ops.moe_step.Link`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import torch

from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor, unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp

log = logging.getLogger(__name__)

STREAM_FORMATS = ("bf16", "int8", "int4")
"""Packed formats GPU prefill unpacks."""


_PINNED: weakref.WeakKeyDictionary[CpuMoE, list[torch.Tensor]] = weakref.WeakKeyDictionary()
"""Each layer's registered mappings as host tensors; unregistered when its `CpuMoE` goes (before
the memory is unmapped, so a later mapping at the same address can be registered again)."""


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
        code = int(cudart.cudaHostRegister(part.address, part.bytes, 0))
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


def streaming_bytes(cpu: Sequence[CpuMoE]) -> int:
    """GPU bytes a streamed pass needs beyond activations: two staging buffers of the largest
    layer's packed experts, and that layer unpacked to bf16 (gate/up and down)."""
    staging = max(sum(p.bytes for p in m.packed_groups()) for m in cpu)
    unpacked = max(m.num_experts * 3 * m.hidden * m.intermediate * 2 for m in cpu)
    return 2 * staging + unpacked


def streaming_refusal(cpu: Sequence[CpuMoE], free_bytes: int) -> str:
    """Why prefill cannot stream these experts to a GPU with `free_bytes` free ("" if it can)."""
    formats = {m.weight_format for m in cpu}
    if not formats <= set(STREAM_FORMATS):
        return (f"GPU prefill unpacks {', '.join(STREAM_FORMATS)} experts, not "
                f"{', '.join(sorted(formats - set(STREAM_FORMATS)))}")
    need = streaming_bytes(cpu)
    if need > 0.8 * free_bytes:  # the rest is the pass's activations
        return (f"GPU prefill needs {need / 2**30:.1f} GiB of GPU memory for one layer's "
                f"experts (staged twice and unpacked), {free_bytes / 2**30:.1f} GiB are free")
    return ""


class LayerStreamer:
    """Staging buffers, the copy stream and the per-layer copies of a model's MoE layers."""

    def __init__(self, cpu: Sequence[CpuMoE], device: torch.device) -> None:
        if any(m.weight_format not in STREAM_FORMATS for m in cpu):
            raise ValueError(streaming_refusal(cpu, 2**62))
        self.cpu, self.device = list(cpu), device
        self.parts = [m.packed_groups() for m in cpu]
        self.host = [pinned_groups(m) for m in cpu]
        self.layer_bytes = [sum(p.bytes for p in parts) for parts in self.parts]
        size = max(self.layer_bytes)
        with torch.inference_mode(False):  # written in place by every pass, in or out of it
            self.staging = [torch.empty(size, dtype=torch.uint8, device=device)
                            for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in cpu]  # layer i's experts are on the GPU
        self.freed = [torch.cuda.Event() for _ in range(2)]  # a buffer's layer is computed
        self.grouped = grouped_mm_available(device)
        self.links = [GpuLink(self, i) for i in range(len(cpu))]
        log.info("GPU prefill: %d layers, %.2f GB of packed experts per pass, %s", len(cpu),
                 sum(self.layer_bytes) / 1e9, "grouped GEMM" if self.grouped else "per expert")

    def bytes_per_pass(self) -> int:
        """Packed expert bytes a prefill pass moves to the GPU."""
        return sum(self.layer_bytes)

    def begin(self) -> None:
        """Starts a pass: the first two layers' copies."""
        for i in range(min(2, len(self.cpu))):
            self._copy(i)

    def _copy(self, i: int) -> None:
        """Copies layer i into buffer i % 2 on the copy stream, after that buffer's last use."""
        buffer = self.staging[i % 2]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[i % 2])
            at = 0
            for host in self.host[i]:
                buffer[at:at + host.numel()].copy_(host, non_blocking=True)
                at += host.numel()
            self.copied[i].record(self.copy_stream)

    def unpacked(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer i's experts from its staging buffer (copied there), per NUMA group (gate_up,
        down) in bf16 (`packed_layout.unpack_group`)."""
        buffer, moe, at = self.staging[i % 2], self.cpu[i], 0
        groups = []
        for part in self.parts[i]:
            raw = buffer[at:at + part.bytes].view(moe.num_experts, part.expert_bytes)
            groups.append(unpack_group(raw, part, moe.weight_format, moe.hidden,
                                       moe.group_size))
            at += part.bytes
        return groups

    def compute(self, i: int, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """Layer i's routed experts on x [T, H] (current stream, after its copy); then the
        copy of layer i + 2 into the freed buffer is queued."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.copied[i])
        out = routed_mlp(x, ids, weights, self.unpacked(i), self.grouped)
        self.freed[i % 2].record(stream)
        if i + 2 < len(self.cpu):
            self._copy(i + 2)
        return out


class GpuLink:
    """`ops.moe_step.Link` of MoE layer i in a GPU prefill pass (no deferral in prefill)."""

    def __init__(self, streamer: LayerStreamer, i: int) -> None:
        self.streamer, self.i = streamer, i
        self.out: torch.Tensor | None = None

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        if deferred:
            raise ValueError("GPU prefill does not defer experts")
        self.out = self.streamer.compute(self.i, x, ids, weights)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        raise RuntimeError("GPU prefill runs the HF layers, not the fused decode step")

    def finish(self) -> torch.Tensor:
        out, self.out = self.out, None
        if out is None:
            raise RuntimeError("GpuLink.finish without start")
        return out

    def finish_late(self) -> torch.Tensor:
        raise RuntimeError("GPU prefill does not defer experts")
