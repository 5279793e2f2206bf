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

Experts resident on the GPU (a placement's `LayerSlots`, engine/placement/slots.py) are never
copied: they are computed from their slots, and only the misses stream
(engine/placement/stream_plan.py). A pass may *split* each layer (engine/placement/expert_split.py):
only k of its misses are copied (as early as a whole layer would be) and computed on the GPU, while
the CPU computes the other misses at the same time; the activations cross to the host once the
router has run and the CPU's sum comes back to be added. On a GPU every pass (a prompt's, or a
decode step streamed: `EngineConfig.stream_decode_rows`) starts and awaits the CPU's share in
stream order through the layer's `HostLink` words, as the decode path does, so the host queues
every layer without waiting for the GPU or the CPU (the planner's `run_pass` waits the jobs at
the end).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from hetmoe.engine.placement.cpu_share import CpuShare, HostSide
from hetmoe.engine.placement.staging_plan import StagingPlan
from hetmoe.engine.placement.stream_memory import host_groups, staged_expert_bytes
from hetmoe.engine.placement.stream_plan import layer_pass
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import unpack_group
from hetmoe.experts.routed_mlp import grouped_mm_available, routed_mlp
from hetmoe.kernels.packed_moe import packed_moe
from hetmoe.kernels.prefill_path import unpack_reason

if TYPE_CHECKING:
    from hetmoe.engine.placement.slots import LayerSlots

log = logging.getLogger(__name__)

STREAM_FORMATS = ("bf16", "int8", "int4", "fp8")
"""Packed formats GPU prefill unpacks."""


def streaming_refusal(cpu: Sequence[CpuMoE], cap: int, staged: int, room: int) -> str:
    """Why prefill cannot stream these experts to the GPU ("" if it can): their format, or a
    cap of 0 staged experts per layer (one takes `staged` GPU bytes, `room` bytes are there for
    experts: engine/placement/staging_plan.py)."""
    formats = {m.weight_format for m in cpu}
    if not formats <= set(STREAM_FORMATS):
        return (f"GPU prefill unpacks {', '.join(STREAM_FORMATS)} experts, not "
                f"{', '.join(sorted(formats - set(STREAM_FORMATS)))}")
    if cap < 1:
        return (f"GPU prefill has no room to stage one expert per layer: one takes {staged} "
                f"bytes ({staged / 2**30:.2f} GiB: its packed bytes twice, plus bf16 where "
                f"prefill unpacks), {max(0, room)} bytes are free for experts")
    return ""


class LayerStreamer:
    """Staging buffers, the copy stream and the per-layer copies of a model's MoE layers. On
    the CPU device (tests) the same copies and compute run in order, with no stream or event.
    `act_quant`: the packed kernels' sorted path on int8 / fp8 tensor cores; `cap`: experts of
    a layer the staging buffers hold, the most misses a pass streams per layer (None: a whole
    layer; engine/placement/staging_plan.py); `host`: each layer's `HostLink` on a GPU, through
    which a split layer runs the CPU's share (engine/placement/cpu_share.py)."""

    def __init__(self, cpu: Sequence[CpuMoE], device: torch.device,
                 act_quant: bool = False, cap: int | None = None,
                 host: Sequence[HostSide] = ()) -> None:
        num_experts = cpu[0].num_experts
        self.cap = num_experts if cap is None else min(cap, num_experts)
        staged = staged_expert_bytes(cpu, device)
        why = streaming_refusal(cpu, self.cap, staged, self.cap * staged)
        if why:
            raise ValueError(why)
        self.staging_plan = StagingPlan(self.cap, num_experts, staged)
        self.cpu, self.device, self.act_quant = list(cpu), device, act_quant
        self.cuda = device.type == "cuda"
        self.parts = [m.packed_groups() for m in cpu]
        self.host = [host_groups(m, device) for m in cpu]
        self.layer_bytes = [sum(p.bytes for p in parts) for parts in self.parts]
        self.expert_bytes = [sum(p.expert_bytes for p in parts) for parts in self.parts]
        self.num_experts = num_experts
        self.gpu_experts = self.cap  # misses streamed per layer, this pass (`begin`)
        self.slots: list[LayerSlots | None] = [None] * len(cpu)  # resident experts (`begin`)
        self.passes = [layer_pass(self.num_experts, (), self.num_experts) for _ in cpu]
        self._local: list[torch.Tensor | None] = [None] * len(cpu)  # [E + 1] per layer:
        # expert -> staging index, -1 elsewhere (made when a layer's pass changes)
        self.copied_bytes = 0  # expert bytes copied since `begin`
        with torch.inference_mode(False):  # written in place by every pass, in or out of it
            self.staging = [torch.empty(self.cap * max(self.expert_bytes), dtype=torch.uint8,
                                        device=device) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied = [torch.cuda.Event() for _ in cpu] if self.cuda else []  # layer i's
        # streamed experts are on the GPU
        self.freed = [torch.cuda.Event() for _ in range(2)] if self.cuda else []  # a
        # buffer's layer is computed
        self.grouped = grouped_mm_available(device)
        why = unpack_reason(device, cpu[0].weight_format)  # the rule `staged` counted
        self.packed_kernel = not why
        if why and self.cuda:
            log.info("GPU prefill unpacks experts to bf16: %s", why)
        self.links = [GpuLink(self, i) for i in range(len(cpu))]
        self.share = CpuShare(cpu, device, host)  # a split layer's CPU experts
        log.info("GPU prefill: %d layers, %.2f GB of packed experts, %s; %s", len(cpu),
                 sum(self.layer_bytes) / 1e9, "packed kernels" if self.packed_kernel
                 else "unpack + grouped GEMM" if self.grouped else "unpack, per expert",
                 self.staging_plan.describe())

    def bytes_per_pass(self) -> int:
        """Packed expert bytes a pass that streams every miss of the last `begin`'s placement
        (without one: every expert), at most `cap` per layer, moves to the GPU."""
        return sum(b * min(self.cap, self.num_experts - (len(s.experts()) if s else 0))
                   for b, s in zip(self.expert_bytes, self.slots, strict=True))

    def begin(self, tokens: int, top_k: int, gpu_experts: int | None = None,
              slots: Sequence[LayerSlots] | None = None) -> None:
        """Starts a pass of `tokens` tokens routed to `top_k` experts each; `slots`: each
        layer's resident experts (a `Placement`'s layers), computed from their slots and never
        copied. Of each layer's other experts (the misses) the first `gpu_experts` (None: as
        many as the staging holds, `cap`) are streamed and the rest computed on the CPU at the
        same time (engine/placement/stream_plan.py); queues the first two layers' copies."""
        k = self.cap if gpu_experts is None else gpu_experts
        if not 0 < k <= self.cap:
            held = "" if self.cap == self.num_experts else \
                f" (the staging buffers hold {self.cap} of a layer's {self.num_experts} experts)"
            raise ValueError(f"gpu_experts must be in [1, {self.cap}], got {k}{held}")
        if slots is not None and len(slots) != len(self.cpu):
            raise ValueError(f"LayerStreamer.begin: slots of {len(slots)} MoE layers for a "
                             f"model of {len(self.cpu)}")
        self.gpu_experts = k
        self.slots = list(slots) if slots is not None else [None] * len(self.cpu)
        for i, s in enumerate(self.slots):
            share = layer_pass(self.num_experts, s.experts() if s is not None else (), k)
            if share != self.passes[i] or (share.streamed and self._local[i] is None):
                self._local[i] = share.local(self.device) if share.streamed else None
            self.passes[i] = share
        self.copied_bytes = self.share.host_waits = 0
        for i in range(min(2, len(self.cpu))):
            self._copy(i)

    def _copy(self, i: int) -> None:
        """Copies layer i's streamed experts of each group (runs of consecutive experts, one
        copy each), side by side, into buffer i % 2 on the copy stream, after that buffer's
        last use (a layer that streams nothing: none)."""
        share = self.passes[i]
        if not share.streamed:
            return
        buffer, count = self.staging[i % 2], len(share.streamed)
        with torch.cuda.stream(self.copy_stream) if self.copy_stream else nullcontext():
            if self.copy_stream is not None:
                self.copy_stream.wait_event(self.freed[i % 2])
            at = 0
            for part, host in zip(self.parts[i], self.host[i], strict=True):
                b = part.expert_bytes
                for first, n, index in share.runs:
                    buffer[at + index * b:at + (index + n) * b].copy_(
                        host[first * b:(first + n) * b], non_blocking=True)
                at += count * b
            if self.copy_stream is not None:
                self.copied[i].record(self.copy_stream)
        self.copied_bytes += count * self.expert_bytes[i]

    def unpacked(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer i's streamed experts on the GPU (its staging buffer), per NUMA group (gate_up,
        down) in bf16 (`packed_layout.unpack_group`), in staging order."""
        moe, at, count = self.cpu[i], 0, len(self.passes[i].streamed)
        groups = []
        for part in self.parts[i]:
            raw = self.staging[i % 2][at:at + count * part.expert_bytes]
            groups.append(unpack_group(raw.view(count, part.expert_bytes), part,
                                       moe.weight_format, moe.hidden, moe.group_size))
            at += count * part.expert_bytes
        return groups

    def computed(self, i: int, x: torch.Tensor, here: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Layer i's streamed experts' output [T, H] fp32 from the packed kernels, each NUMA
        group's slice summed; `here` [T, K]: staging indices (-1: not streamed)."""
        moe, at, total = self.cpu[i], 0, None
        count = len(self.passes[i].streamed)
        for part in self.parts[i]:
            raw = self.staging[i % 2][at:at + count * part.expert_bytes]
            out = packed_moe(x, here, weights, raw, part, moe.weight_format, moe.hidden,
                             moe.group_size, act_quant=self.act_quant)
            total = out if total is None else total + out
            at += count * part.expert_bytes
        assert total is not None
        return total.float()

    def _streamed(self, i: int, x: torch.Tensor, ids: torch.Tensor, here: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """The streamed experts' pairs of layer i [T, H] fp32 (kernels on their staging
        indices `here` [T, K], or unpack + GEMM)."""
        local = self._local[i]
        assert local is not None
        if self.packed_kernel:
            return self.computed(i, x, here, weights)
        every = len(self.passes[i].streamed) == self.num_experts
        return routed_mlp(x, ids, weights, self.unpacked(i), self.grouped,
                          None if every else local[:-1]).float()

    def start(self, i: int, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts layer i's routed experts on x [T, H]: the CPU's share (a split layer) at
        once, the resident experts from their slots, the streamed ones after their copy, then
        the copy of layer i + 2 into the freed buffer. The returned function (called after
        whatever the caller queues meanwhile, e.g. the shared experts) waits for the CPU and
        returns the layer's routed output [T, H], every part summed once."""
        share, slots = self.passes[i], self.slots[i]
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        # slot [T, K]: resident slots (-1 elsewhere); cpu_ids: the ids less the resident ones
        slot, cpu_ids = slots.split(ids) if slots is not None and slots.slots else (None, ids)
        local = self._local[i]
        here = local[ids] if local is not None else None  # [T, K] staging index or -1
        cpu: Callable[[], torch.Tensor] | None = None  # waits; the CPU's sum, GPU-readable
        if share.cpu:  # the CPU's ids: neither resident nor streamed
            assert cpu_ids is not None  # split gives None only when every expert is resident
            if here is not None:
                cpu_ids = torch.where(here < 0, cpu_ids, -1)
            cpu = self.share.start(i, x, cpu_ids, weights, stream)
        parts = []  # [T, H] fp32 each
        if slot is not None:  # no copy to wait for
            assert slots is not None
            parts.append(slots.compute(x, ids, slot, weights))
        if here is not None:
            if stream is not None:
                stream.wait_event(self.copied[i])
            parts.append(self._streamed(i, x, ids, here, weights))
            if stream is not None:
                self.freed[i % 2].record(stream)
        if i + 2 < len(self.cpu):
            self._copy(i + 2)
        gpu = functools.reduce(torch.add, parts) if parts else \
            x.new_zeros(x.shape, dtype=torch.float32)
        if cpu is None:
            return lambda: gpu.to(x.dtype)
        # The CPU's sum is read in place over PCIe by the add itself: a copy would queue on the
        # copy engine behind the next layers' expert copies.
        return lambda: (gpu + cpu()).to(x.dtype)


class GpuLink:
    """`ops.moe_step.Link` of MoE layer i in a GPU prefill pass (no deferral in prefill). It
    holds its streamer weakly: a dropped streamer (`MoEOverlap.place`) frees its staging and the
    old placement's slots at once, not at the next garbage collection."""

    def __init__(self, streamer: LayerStreamer, i: int) -> None:
        self._streamer, self.i = weakref.ref(streamer), i
        self.pending: Callable[[], torch.Tensor] | None = None

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        if deferred:
            raise ValueError("GPU prefill does not defer experts")
        streamer = self._streamer()
        if streamer is None:
            raise RuntimeError("GpuLink.start: its streamer was dropped (a new placement)")
        self.pending = streamer.start(self.i, x, ids, weights)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        raise RuntimeError("GPU prefill runs the HF layers, not the fused decode step")

    def finish(self) -> torch.Tensor:
        if self.pending is None:
            raise RuntimeError("GpuLink.finish without start")
        pending, self.pending = self.pending, None
        return pending()

    def finish_late(self) -> torch.Tensor:
        raise RuntimeError("GPU prefill does not defer experts")
