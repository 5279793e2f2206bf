"""What `hetmoe convert` will write, known before a byte is read: every file and its exact size.

`plan_convert(checkpoint, weight_format, group_size)` builds the meta skeleton, injects the
family's rules with the cpu expert backend, and asks each routed-expert layer's `CpuMoE` (only
address space until experts load) for its packed groups: a layer file is those groups at
2 MiB-aligned offsets. Non-expert weights go into one safetensors file whose header is built
here, so its size is exact too. `hetmoe convert --dry-run` and `hetmoe info` print this plan.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.inject.apply import apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import load_rules, shipped_rules_path
from hetmoe.loading.checkpoint import Checkpoint, CheckpointTensor
from hetmoe.loading.converted import ALIGN
from hetmoe.loading.load import _config_dtype
from hetmoe.loading.skeleton import build_skeleton
from hetmoe.loading.tensor_file import _DTYPES

WEIGHTS_FILE = "model.safetensors"
_SAFETENSORS_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerPlan:
    """One MoE layer's packed experts file."""

    module: str
    """Qualified name of the layer's expert backend module."""
    file: str
    """Path inside OUT (`experts/layer-NNN.bin`)."""
    shape: tuple[int, int, int]
    """(num_experts, hidden, intermediate)."""
    activation: str
    """The experts' activation (silu)."""
    groups: tuple[dict[str, int], ...]
    """Per NUMA group: offset in the file, bytes, expert_bytes, down_offset, begin, end."""
    tensors: tuple[CheckpointTensor, ...]
    """The checkpoint tensors of these experts."""

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed experts (the mappings; padding between sections excluded)."""
        return sum(g["bytes"] for g in self.groups)

    @property
    def file_bytes(self) -> int:
        """Size of the file: the last section's end."""
        last = self.groups[-1]
        return last["offset"] + last["bytes"]


@dataclass(frozen=True)
class ConvertPlan:
    """Every file a conversion writes, with its size."""

    checkpoint: Checkpoint
    """The source, opened."""
    dtype: torch.dtype
    """The load dtype (what the engine would hand the experts): the checkpoint's."""
    weight_format: str
    """Packed expert format."""
    group_size: int | None
    """Its quantization group (None for bf16)."""
    layers: tuple[LayerPlan, ...]
    """The MoE layers' files."""
    weights: tuple[tuple[CheckpointTensor, torch.dtype], ...]
    """Non-expert tensors and the dtype each is stored in."""
    header: bytes
    """The non-expert safetensors header (length prefix included)."""
    skeleton: nn.Module
    """The injected meta skeleton the plan was read from (for `memory_plan`)."""

    @property
    def weights_bytes(self) -> int:
        """Bytes of the non-expert tensors (the safetensors file minus its header)."""
        return sum(_out_bytes(t, d) for t, d in self.weights)

    @property
    def packed_bytes(self) -> int:
        """Bytes of all packed experts."""
        return sum(layer.packed_bytes for layer in self.layers)

    def file_sizes(self) -> dict[str, int]:
        """Each data file of OUT and its size (the small copied files aside)."""
        sizes = {layer.file: layer.file_bytes for layer in self.layers}
        sizes[WEIGHTS_FILE] = len(self.header) + self.weights_bytes
        return sizes


def plan_convert(checkpoint: Checkpoint, weight_format: str,
                 group_size: int | None) -> ConvertPlan:
    """The plan of converting `checkpoint` with experts in `weight_format` (see module doc)."""
    dtype = _config_dtype(checkpoint)
    model = build_skeleton(checkpoint.config, dtype)
    rules = load_rules(shipped_rules_path(checkpoint.family.model_type))
    apply_rules(model, rules, OpContext(torch.device("cpu"), dtype, checkpoint.config, "cpu",
                                        checkpoint.fp8))
    layers: list[LayerPlan] = []
    chosen = group_size
    owned: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, CpuExperts):
            continue
        spec = module.spec
        shape = (spec.num_experts, spec.hidden_size, spec.intermediate_size)
        moe = CpuMoE(*shape, weight_format=weight_format, group_size=group_size)
        chosen = moe.group_size  # the format's default when group_size is None
        groups, offset = [], 0
        for part in moe.packed_groups():
            groups.append({"offset": offset, "bytes": part.bytes,
                           "expert_bytes": part.expert_bytes, "down_offset": part.down_offset,
                           "begin": part.begin, "end": part.end})
            offset = _round_up(offset + part.bytes, ALIGN)
        tensors = tuple(t for key, t in checkpoint.tensors.items() if key.startswith(name + "."))
        owned.update(t.name for t in tensors)
        number = _LAYER.search(name + ".")
        file = f"experts/layer-{int(number.group(1)) if number else len(layers):03d}.bin"
        layers.append(LayerPlan(name, file, shape, spec.activation, tuple(groups), tensors))
    weights = tuple((t, _stored_dtype(t, dtype)) for key, t in checkpoint.tensors.items()
                    if key not in owned)
    return ConvertPlan(checkpoint, dtype, weight_format, chosen,
                       tuple(layers), weights, safetensors_header(weights), model)


def safetensors_header(weights: tuple[tuple[CheckpointTensor, torch.dtype], ...]) -> bytes:
    """The safetensors header (8-byte length, JSON padded to 8 bytes) of `weights` in order,
    under their stored names."""
    table: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for tensor, dtype in weights:
        size = _out_bytes(tensor, dtype)
        table[tensor.entry.name] = {"dtype": _SAFETENSORS_NAMES[dtype],
                                    "shape": list(tensor.shape), "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _stored_dtype(tensor: CheckpointTensor, dtype: torch.dtype) -> torch.dtype:
    """FP8 weights are stored dequantized in the load dtype; the rest as the source has them."""
    return dtype if tensor.scale_inv is not None else tensor.entry.dtype


def _out_bytes(tensor: CheckpointTensor, dtype: torch.dtype) -> int:
    numel = 1
    for d in tensor.shape:
        numel *= d
    return numel * dtype.itemsize


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def copied_files(source: Path) -> list[str]:
    """The source's small files a converted directory keeps (tokenizer, chat template,
    generation config, ...): all but weights, indexes and hidden files; config.json apart."""
    skip = {"config.json", "model.safetensors.index.json"}
    return sorted(p.name for p in source.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in skip
                  and p.suffix not in (".safetensors", ".gguf", ".bin"))
