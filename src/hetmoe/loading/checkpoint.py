"""A checkpoint directory: config.json plus safetensors (single file or sharded), in module space.

`Checkpoint.open(path)` reads the config (transformers `AutoConfig`, no remote code unless asked),
checks the family, parses every safetensors header, renames tensors into module space with the
family's name map, pairs FP8 weights with their `weight_scale_inv`, and skips what no model
module owns (layers past `num_hidden_layers`, e.g. DeepSeek-V3's MTP layer, and stored rotary
`inv_freq`). No tensor data is read until `tensor()` is called.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from hetmoe.experts.fp8_weight import FP8_DTYPES, Fp8Scheme, Fp8Weight
from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.families import FAMILIES, Family
from hetmoe.loading.fp8 import fp8_scheme
from hetmoe.loading.tensor_file import TensorEntry, read_header, read_tensor

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor the model needs, under its module-space name."""

    name: str
    """Module-space name (after the family's renames)."""
    entry: TensorEntry
    """Where and how it is stored (`entry.name` is the on-disk name)."""
    scale_inv: TensorEntry | None = None
    """FP8 block scales of `entry`, when it is stored as float8."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape once loaded (the stored shape)."""
        return self.entry.shape

    def describe(self) -> str:
        """`'name' in file` for error messages (with the on-disk name when renamed)."""
        stored = "" if self.entry.name == self.name else f" (stored as {self.entry.name!r})"
        return f"tensor {self.name!r}{stored} in {self.entry.file.name}"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, opened: config, family and tensor table; data read on demand."""

    path: Path
    """The directory."""
    config: Any
    """transformers config (`quantization_config` removed: weights are dequantized at load)."""
    family: Family
    """Loading facts of `config.model_type`."""
    tensors: dict[str, CheckpointTensor]
    """Tensors by module-space name, in file order."""
    fp8: Fp8Scheme | None
    """Block scaling of FP8 weights, when the checkpoint has any."""

    @classmethod
    def open(cls, path: str | Path, *, trust_remote_code: bool = False) -> Checkpoint:
        """Opens `path` (a directory with config.json and safetensors); reads headers only."""
        path = Path(path).expanduser()
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path}: no config.json; expected a checkpoint directory")
        model_type = json.loads(config_file.read_text()).get("model_type")
        family = FAMILIES.get(model_type or "")
        if family is None:
            raise CheckpointError(
                f"{config_file}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(FAMILIES)}"
            )
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        for key, value in family.config_defaults.items():
            if getattr(config, key, None) is None:
                setattr(config, key, value)
        fp8 = None
        quantization = getattr(config, "quantization_config", None)
        if quantization is not None:
            fp8 = fp8_scheme(quantization, str(config_file))
            del config.quantization_config
        entries = _stored_entries(path)
        tensors = _module_tensors(entries, family, config.num_hidden_layers, fp8, path)
        return cls(path, config, family, tensors, fp8)

    def tensor(
        self, item: CheckpointTensor, dtype: torch.dtype | None = None, *, f: FileIO | None = None
    ) -> torch.Tensor:
        """A CPU tensor of `item`, FP8 dequantized; floating data cast to `dtype` if given."""
        value = read_tensor(item.entry, f=f)
        if item.scale_inv is not None and self.fp8 is not None:
            value = self.fp8.dequantize(value, read_tensor(item.scale_inv))
        if dtype is not None and value.dtype != dtype:
            value = value.to(dtype)
        return value

    def owner_tensor(self, item: CheckpointTensor, dtype: torch.dtype, keep_fp8: bool, *,
                     f: FileIO | None = None) -> torch.Tensor | Fp8Weight:
        """What a `load_tensor` owner receives: an `Fp8Weight` as stored when the owner keeps
        FP8 and `item` is FP8 block-scaled, else `tensor(item, dtype)` (floating data cast)."""
        if keep_fp8 and item.scale_inv is not None and self.fp8 is not None:
            return Fp8Weight(read_tensor(item.entry, f=f), read_tensor(item.scale_inv), self.fp8)
        return self.tensor(item, dtype if item.entry.dtype.is_floating_point else None, f=f)

    @property
    def nbytes(self) -> int:
        """Bytes stored on disk for the tensors the model needs."""
        return sum(t.entry.nbytes for t in self.tensors.values())


def _stored_entries(path: Path) -> list[TensorEntry]:
    """Every tensor of the directory's safetensors, via the index when there is one."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text()).get("weight_map", {})
        entries: list[TensorEntry] = []
        headers: dict[str, dict[str, TensorEntry]] = {}
        for name, file in weight_map.items():
            if file not in headers:
                if not (path / file).is_file():
                    raise CheckpointError(
                        f"{index_file}: shard {file!r} (holding {name!r}) does not exist in {path}"
                    )
                headers[file] = read_header(path / file)
            if name not in headers[file]:
                raise CheckpointError(
                    f"{index_file}: maps {name!r} to shard {file!r}, whose header lacks it"
                )
            entries.append(headers[file][name])
        return entries
    if (path / SINGLE_FILE).is_file():
        return list(read_header(path / SINGLE_FILE).values())
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _module_tensors(
    entries: list[TensorEntry],
    family: Family,
    num_layers: int,
    fp8: Fp8Scheme | None,
    path: Path,
) -> dict[str, CheckpointTensor]:
    """Renames into module space, pairs FP8 scales with their weights, drops what no module owns."""
    by_name: dict[str, TensorEntry] = {}
    scales: dict[str, TensorEntry] = {}
    for entry in entries:
        name = family.module_name(entry.name)
        layer = _LAYER.search(name)
        if (layer and int(layer.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq"):
            log.debug("skipping %s from %s: no module owns it", entry.name, entry.file.name)
            continue
        if name.endswith(_SCALE_SUFFIX):
            scales[name.removesuffix(_SCALE_SUFFIX)] = entry
        else:
            by_name[name] = entry
    tensors: dict[str, CheckpointTensor] = {}
    for name, entry in by_name.items():
        scale = scales.pop(name, None)
        if entry.dtype in FP8_DTYPES or scale is not None:
            _check_fp8(name, entry, scale, fp8, path)
        tensors[name] = CheckpointTensor(name, entry, scale)
    if scales:
        orphan = next(iter(scales.values()))
        raise CheckpointError(
            f"{orphan.file}: {orphan.name!r} scales a weight the checkpoint does not have "
            f"({len(scales)} such scale tensors)"
        )
    return tensors


def _check_fp8(
    name: str, weight: TensorEntry, scale: TensorEntry | None, fp8: Fp8Scheme | None, path: Path
) -> None:
    where = f"{weight.file.name}: tensor {weight.name!r}"
    if scale is None:
        raise CheckpointError(f"{where} is {weight.dtype} but has no weight_scale_inv tensor")
    if fp8 is None:
        raise CheckpointError(
            f"{where} has a scale {scale.name!r}, but {path / 'config.json'} has no "
            "quantization_config with weight_block_size"
        )
    if weight.dtype not in FP8_DTYPES or len(weight.shape) != 2:
        raise CheckpointError(
            f"{where} has a scale {scale.name!r} but is {weight.dtype} {list(weight.shape)}; "
            "expected a 2-D float8 weight"
        )
    expected = fp8.scale_shape(weight.shape)
    if scale.shape != expected:
        raise CheckpointError(
            f"{where} {list(weight.shape)} and its scale {scale.name!r} in {scale.file.name} "
            f"{list(scale.shape)} disagree: blocks of {fp8.block_rows}x{fp8.block_cols} "
            f"need a scale of shape {list(expected)}"
        )
