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

A pass of fewer tokens *splits* each layer instead (engine/expert_split.py): once its router has
run, its lightest experts run on the CPU (through the layer's CPU link, the other ids masked to
-1) while the rest are copied, packed side by side, and computed on the GPU; experts no token
chose are neither copied nor computed. The copies then wait for the router, so a pass splits
only when the costs measured at its first use say that beats streaming every expert ahead.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch

from hetmoe.engine.expert_split import SplitCosts, measure_cpu_costs, plan_split, prefer_split
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor, unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp

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
        self.costs: SplitCosts | None = None  # measured at the first pass that may split
        self.split = False  # this pass splits its layers (`begin`)
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

    def begin(self, tokens: int, top_k: int, split: bool | None = None) -> None:
        """Starts a pass of `tokens` tokens routed to `top_k` experts each: splits its layers
        (`split` True, or None and the costs favour it), else queues the first two layers'
        copies."""
        if split is None:
            split = prefer_split(tokens, top_k, self.cpu[0].num_experts, self.split_costs())
        self.split = split
        if not self.split:
            for i in range(min(2, len(self.cpu))):
                self._copy(i)

    def split_costs(self) -> SplitCosts:
        """Per-expert costs of each side, measured once: the CPU experts of layer 0, and a copy
        of its packed experts."""
        if self.costs is None:
            fixed, token = measure_cpu_costs(self.cpu[0])
            self.costs = SplitCosts(fixed, token, self.measure_copy() / self.cpu[0].num_experts)
            log.info("GPU prefill split costs: %s", self.costs)
        return self.costs

    def measure_copy(self, repeats: int = 2) -> float:
        """Seconds to copy layer 0's packed experts to the GPU (best of `repeats`)."""
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            self._copy(0)
            end.record(self.copy_stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

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

    def unpacked(self, i: int, experts: int | None = None) -> list[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
        """Layer i's experts from its staging buffer (copied there), per NUMA group (gate_up,
        down) in bf16 (`packed_layout.unpack_group`); `experts`: only the first that many of
        each group (a split's copies, packed side by side)."""
        buffer, moe, at = self.staging[i % 2], self.cpu[i], 0
        count = moe.num_experts if experts is None else experts
        groups = []
        for part in self.parts[i]:
            raw = buffer[at:at + count * part.expert_bytes].view(count, part.expert_bytes)
            groups.append(unpack_group(raw, part, moe.weight_format, moe.hidden,
                                       moe.group_size))
            at += count * part.expert_bytes
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


    def start_split(self, i: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Splits layer i's experts (see the module docstring): starts the CPU's share and the
        copies of the GPU's; the returned function queues the GPU's products (after whatever
        the caller queued meanwhile, e.g. the shared experts), waits for the CPU and returns
        the layer's routed output [T, H]."""
        moe = self.cpu[i]
        counts = torch.bincount(ids.reshape(-1), minlength=moe.num_experts).cpu()  # waits
        # for the router
        on_gpu = plan_split(counts, self.split_costs())
        on_cpu = (counts > 0) & ~on_gpu
        call = None
        if on_cpu.any():
            host_ids = ids.cpu()
            host_x = x.to("cpu", torch.float32 if x.dtype == torch.float16 else x.dtype)
            call = moe.submit(host_x, torch.where(on_cpu[host_ids], host_ids, -1),
                              weights.to("cpu", torch.float32))
        gpu = on_gpu.nonzero().squeeze(1)  # [G], ascending
        if len(gpu):
            self._copy_experts(i, gpu.tolist())

        def finish() -> torch.Tensor:
            out = None
            if len(gpu):
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(self.copied[i])
                local = torch.full((moe.num_experts,), -1, dtype=torch.int64)
                local[gpu] = torch.arange(len(gpu))
                out = routed_mlp(x, ids, weights, self.unpacked(i, len(gpu)), self.grouped,
                                 local.to(self.device, non_blocking=True))
                self.freed[i % 2].record(stream)
            if call is not None:
                cpu_out = moe.sync(call).to(x.device, x.dtype)
                out = cpu_out if out is None else out + cpu_out
            return out if out is not None else torch.zeros_like(x)

        return finish

    def _copy_experts(self, i: int, experts: list[int]) -> None:
        """Copies the packed `experts` (ascending) of layer i side by side into buffer i % 2,
        each group's after the previous group's, one copy per run of consecutive experts."""
        runs: list[list[int]] = []
        for e in experts:
            if runs and runs[-1][1] == e:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        buffer, at = self.staging[i % 2], 0
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[i % 2])
            for part, host in zip(self.parts[i], self.host[i], strict=True):
                size = part.expert_bytes
                for first, end in runs:
                    n = (end - first) * size
                    buffer[at:at + n].copy_(host[first * size:end * size], non_blocking=True)
                    at += n
            self.copied[i].record(self.copy_stream)


class GpuLink:
    """`ops.moe_step.Link` of MoE layer i in a GPU prefill pass (no deferral in prefill)."""

    def __init__(self, streamer: LayerStreamer, i: int) -> None:
        self.streamer, self.i = streamer, i
        self.out: torch.Tensor | None = None
        self.pending: Callable[[], torch.Tensor] | None = None  # a split layer's rest

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        if deferred:
            raise ValueError("GPU prefill does not defer experts")
        if self.streamer.split:
            self.pending = self.streamer.start_split(self.i, x, ids, weights)
        else:
            self.out = self.streamer.compute(self.i, x, ids, weights)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        raise RuntimeError("GPU prefill runs the HF layers, not the fused decode step")

    def finish(self) -> torch.Tensor:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            return pending()
        out, self.out = self.out, None
        if out is None:
            raise RuntimeError("GpuLink.finish without start")
        return out

    def finish_late(self) -> torch.Tensor:
        raise RuntimeError("GPU prefill does not defer experts")
