"""A converted model directory (`hetmoe convert`): its manifest, checked, and its experts mapped.

    OUT/manifest.json        written last: format version, family, expert format, layers, files
    OUT/config.json ...      config, tokenizer, chat template, generation config (copied)
    OUT/model.safetensors    every non-expert weight (FP8 dequantized)
    OUT/experts/layer-NNN.bin  one MoE layer's packed experts: NUMA group g's mapping
                             (`CpuMoE.packed_groups()[g]`, byte for byte) at a 2 MiB-aligned offset

`open_converted(path)` refuses a foreign version, a missing or resized file, a file whose first
MiB changed, or a layer whose shapes disagree with the config, naming the file and the problem;
`verify=True` also recomputes every full checksum. `ConvertedModel.map_experts(model)` then
hands each layer file to its `CpuExperts` as read-only mappings: no packing, no copy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.loading.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "hetmoe-converted"
VERSION = 1
ALIGN = 2 << 20
"""Layer file sections start on 2 MiB boundaries (huge-page sized)."""
HEAD_BYTES = 1 << 20
"""Bytes of each file hashed at every load (`head`); the full checksum is `--verify`'s."""
_GROUP_FIELDS = ("bytes", "expert_bytes", "down_offset", "begin", "end")


def is_converted(path: Path) -> bool:
    """Whether `path` is a converted directory (it has a manifest)."""
    return (path / MANIFEST).is_file()


def file_digest(path: Path, limit: int | None = None) -> str:
    """blake2b-128 hex of the file's first `limit` bytes (all of it for None)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as f:
        left = limit
        while left is None or left > 0:
            chunk = f.read(8 << 20 if left is None else min(8 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """The manifest's entry of a written file: bytes, head and full checksums."""
    return {"bytes": path.stat().st_size, "head": file_digest(path, HEAD_BYTES),
            "blake2b": file_digest(path)}


@dataclass(frozen=True)
class ConvertedModel:
    """A converted directory whose manifest and files passed the checks."""

    path: Path
    """The directory."""
    manifest: dict[str, Any]
    """manifest.json as read."""

    @property
    def weight_format(self) -> str:
        """The packed experts' format (bf16, int8, int4)."""
        return str(self.manifest["experts"]["format"])

    @property
    def group_size(self) -> int | None:
        """The int formats' quantization group (None for bf16)."""
        group = self.manifest["experts"]["group_size"]
        return int(group) if group else None

    def map_experts(self, model: nn.Module, populate: bool = False) -> None:
        """Serves every routed-expert layer of `model` (its cpu backend modules, injected as
        the manifest lists them) from its layer file. Shapes and NUMA groups are checked first."""
        modules = dict(model.named_modules())
        for layer in self.manifest["layers"]:
            file = self.path / layer["file"]
            experts = modules.get(layer["module"])
            if not isinstance(experts, CpuExperts):
                found = type(experts).__name__ if experts is not None else "nothing"
                raise CheckpointError(f"{file}: holds packed CPU experts for module "
                                      f"{layer['module']!r}, where the model has {found} (the "
                                      "cpu expert backend is needed: experts=cpu)")
            spec = experts.spec
            shape = (spec.num_experts, spec.hidden_size, spec.intermediate_size)
            stored = (layer["num_experts"], layer["hidden"], layer["intermediate"])
            if shape != stored:
                raise CheckpointError(f"{file}: packed experts [E, H, I] = {list(stored)}, the "
                                      f"config's layer needs {list(shape)}")
            moe = CpuMoE(*shape, weight_format=self.weight_format, group_size=self.group_size,
                         activation=spec.activation)
            _check_groups(file, moe, layer["groups"])
            moe.map_file(str(file), [g["offset"] for g in layer["groups"]], populate)
            experts.moe = moe
            experts.mark_loaded()


def open_converted(path: Path, verify: bool = False) -> ConvertedModel:
    """Reads and checks `path`'s manifest and files (see the module docstring)."""
    manifest_file = path / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_file}: cannot read it as JSON ({exc})") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"{manifest_file}: not a hetmoe converted-model manifest "
                              f"(format {found!r}, expected {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_file}: format version {manifest.get('version')!r}, this hetmoe reads "
            f"version {VERSION}; convert the model again with this hetmoe")
    for name, record in manifest["files"].items():
        check_file(path / name, record, verify)
    return ConvertedModel(path, manifest)


def check_file(file: Path, record: dict[str, Any], verify: bool) -> None:
    """Refuses a missing file, a size other than `record`'s, a changed first MiB, and with
    `verify` a changed full checksum."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the manifest lists it, {record['bytes']} bytes)")
    size = file.stat().st_size
    if size != record["bytes"]:
        what = "truncated" if size < record["bytes"] else "longer than written"
        raise CheckpointError(f"{file}: {what}: {size} bytes, the manifest says "
                              f"{record['bytes']}")
    if file_digest(file, HEAD_BYTES) != record["head"]:
        raise CheckpointError(f"{file}: corrupt: its first MiB does not match the manifest's "
                              "checksum")
    if verify and file_digest(file) != record["blake2b"]:
        raise CheckpointError(f"{file}: corrupt: blake2b checksum differs from the manifest's")


def _check_groups(file: Path, moe: Any, groups: list[dict[str, int]]) -> None:
    parts = moe.packed_groups()
    if len(parts) != len(groups):
        raise CheckpointError(
            f"{file}: packed for {len(groups)} NUMA groups, this machine's CPU pool has "
            f"{len(parts)} (convert on this machine, or set HETMOE_NUMA_GROUPS={len(groups)})")
    for g, (part, want) in enumerate(zip(parts, groups, strict=True)):
        for key in _GROUP_FIELDS:
            if getattr(part, key) != want[key]:
                raise CheckpointError(
                    f"{file}: group {g} {key} = {want[key]} in the manifest, the layer's packed "
                    f"layout needs {getattr(part, key)} (converted by another hetmoe layout?)")
