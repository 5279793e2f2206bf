"""Host and GPU bytes of a model before it loads, and whether they fit this machine.

`memory_plan(model, ...)` reads an injected meta skeleton: routed experts in the cpu backend
count their packed bytes on the host (asked of `CpuMoE`, which only reserves address space),
every other parameter and buffer its bytes on the device that will hold it, and the KV cache
its slots x window. Free memory is /proc/meminfo's MemAvailable and `torch.cuda.mem_get_info`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.kernels.prefill_path import unpack_reason

GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per component and place (host or gpu), with what this machine has free."""

    rows: tuple[tuple[str, str, int], ...]
    """(component, "host" or "gpu", bytes)."""
    host_free: int
    """MemAvailable of /proc/meminfo."""
    gpu_free: int | None
    """Free bytes of the GPU (None: no GPU in the plan)."""
    expert_layers: tuple[tuple[int, int], ...] = ()
    """Per MoE layer with cpu experts: (experts, packed bytes of one expert)."""
    gpu_total: int = 0
    """The GPU's memory (0: no GPU in the plan)."""
    gpu_unpacks: bool = False
    """Whether a GPU prefill unpacks the experts to bf16 (kernels/prefill_path.py; False: the
    packed kernels read them as they lie, or no GPU)."""

    def total(self, place: str) -> int:
        """Bytes planned on `place`."""
        return sum(b for _, p, b in self.rows if p == place)

    def refusal(self) -> str:
        """Why the model does not fit ("" when it does)."""
        problems = []
        if self.total("host") > self.host_free:
            problems.append(f"host memory: needs {self.total('host') / GB:.2f} GB, "
                            f"{self.host_free / GB:.2f} GB available")
        if self.gpu_free is not None and self.total("gpu") > self.gpu_free:
            problems.append(f"GPU memory: needs {self.total('gpu') / GB:.2f} GB, "
                            f"{self.gpu_free / GB:.2f} GB free")
        if not problems:
            return ""
        parts = ", ".join(f"{name} {b / GB:.2f} GB ({place})" for name, place, b in self.rows)
        return f"the model does not fit: {'; '.join(problems)} [{parts}]"

    def table(self) -> str:
        """One line per component, totals, free memory and the verdict."""
        lines = [f"{name:<36} {place:<5} {b / GB:10.3f} GB  ({b} bytes)"
                 for name, place, b in self.rows]
        lines.append(f"{'total host':<36} {'':<5} {self.total('host') / GB:10.3f} GB  "
                     f"(available {self.host_free / GB:.2f} GB)")
        if self.gpu_free is not None:
            lines.append(f"{'total GPU':<36} {'':<5} {self.total('gpu') / GB:10.3f} GB  "
                         f"(free {self.gpu_free / GB:.2f} GB)")
        lines.append(f"fits this machine: {'no: ' + self.refusal() if self.refusal() else 'yes'}")
        return "\n".join(lines)


def host_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def memory_plan(model: nn.Module, device: torch.device, dtype: torch.dtype, config: Any,
                kv_tokens: int, weight_format: str | None = None,
                group_size: int | None = None) -> MemoryPlan:
    """The plan of the injected skeleton `model` loaded onto `device`, with a KV cache of
    `kv_tokens` (slots x window); `weight_format`/`group_size` override the cpu experts'."""
    place = "gpu" if device.type == "cuda" else "host"
    packed, formats, layers = 0, set(), []
    for module in model.modules():
        if isinstance(module, CpuExperts):
            moe = module.moe
            if weight_format is not None:
                moe = CpuMoE(moe.num_experts, moe.hidden, moe.intermediate,
                             weight_format=weight_format, group_size=group_size)
            packed += sum(p.bytes for p in moe.packed_groups())
            formats.add(moe.weight_format)
            layers.append((moe.num_experts, sum(p.expert_bytes for p in moe.packed_groups())))
    weights = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                  for t in list(model.parameters()) + list(model.buffers()))
    rows = [(f"routed experts ({'/'.join(sorted(formats))}, packed)", "host", packed),
            ("other weights", place, weights),
            (f"KV cache ({kv_tokens} tokens)", place, kv_tokens * kv_bytes_per_token(config,
                                                                                   dtype))]
    gpu_free, gpu_total = (tuple(int(b) for b in torch.cuda.mem_get_info(device))
                           if device.type == "cuda" else (None, 0))
    unpacks = device.type == "cuda" and any(unpack_reason(device, f) for f in formats)
    return MemoryPlan(tuple(r for r in rows if r[2] or r[0] == "other weights"),
                      host_available(), gpu_free, tuple(layers), gpu_total, unpacks)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """KV-cache bytes of one token over all layers (MLA: latent + rotary key; else K and V)."""
    layers = int(config.num_hidden_layers)
    rank = getattr(config, "kv_lora_rank", None)
    if rank:
        return layers * (int(rank) + int(config.qk_rope_head_dim)) * dtype.itemsize
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers * 2 * heads * int(head_dim) * dtype.itemsize
