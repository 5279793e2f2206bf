"""The memory a GPU pass over packed experts takes: the host mappings it copies from, registered
as pinned memory once per layer (the layer stream's copies and the placement's slot fills are
DMA from them), and the GPU bytes a streamed pass stages (engine/placement/staging_plan.py's
rule on a model's layers; the placement's `auto` budget leaves them free). Below both
engine/placement/layer_stream.py and engine/placement/slots.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from hetmoe.engine.placement.staging_plan import StagingPlan, plan_staging
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.experts.packed_layout import host_tensor
from hetmoe.kernels.prefill_path import unpack_reason

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


def host_groups(moe: CpuMoE, device: torch.device) -> list[torch.Tensor]:
    """`moe`'s packed group mappings as host tensors to copy from to `device`: registered as
    pinned memory on CUDA (`pinned_groups`), plain elsewhere (the CPU standing in for the GPU)."""
    if device.type == "cuda":
        return pinned_groups(moe)
    return [host_tensor(p) for p in moe.packed_groups()]


def _unregister(addresses: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def staged_expert_bytes(cpu: Sequence[CpuMoE], device: torch.device) -> int:
    """GPU bytes one staged expert of `cpu`'s largest takes (`StagingPlan.expert_bytes`): its
    packed bytes in each of two staging buffers, plus its bf16 gate/up and down where prefill
    on `device` unpacks (kernels/prefill_path.py)."""
    packed = max(sum(p.expert_bytes for p in m.packed_groups()) for m in cpu)
    unpacks = any(unpack_reason(device, m.weight_format) for m in cpu)
    unpacked = max(3 * m.hidden * m.intermediate * 2 for m in cpu) if unpacks else 0
    return 2 * packed + unpacked


def stream_staging(cpu: Sequence[CpuMoE], device: torch.device, room: int, gpu_total: int,
                   asked: int | str = "auto") -> StagingPlan:
    """`plan_staging` for `cpu`'s layers on `device` with `room` bytes for experts and staging,
    a GPU of `gpu_total` bytes and the resident budget `asked`."""
    every = sum(m.num_experts * sum(p.expert_bytes for p in m.packed_groups()) for m in cpu)
    return plan_staging(max(m.num_experts for m in cpu), staged_expert_bytes(cpu, device), room,
                        gpu_total, asked, every)
