"""`hetmoe convert`: a checkpoint directory (or GGUF file, or preset) into a converted directory.

Resumable and atomic: each file is written under `NAME.part`, renamed when complete, and its
size and checksums recorded in `.convert-state.json`; a rerun skips the files recorded there
(and present at their size). `manifest.json` is written last, so a half-converted directory
never loads. The disk is checked up front for the bytes still to write.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetmoe.experts.backend import ExpertSpec
from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.packed_layout import host_tensor
from hetmoe.loading.checkpoint import Checkpoint
from hetmoe.loading.convert_plan import (
    WEIGHTS_FILE,
    ConvertPlan,
    LayerPlan,
    copied_files,
    plan_convert,
)
from hetmoe.loading.converted import FORMAT, MANIFEST, VERSION, file_record
from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.progress import byte_progress

STATE = ".convert-state.json"
_SLACK = 64 << 20  # config, tokenizer, manifest, state: far less than this


@dataclass(frozen=True)
class ConvertOptions:
    """What `convert` makes of the experts, and how it reports."""

    weight_format: str = "bf16"
    """Packed expert format: bf16, int8, int4 or fp8."""
    group_size: int | None = None
    """Quantization group of int8/int4 (None: the format's default)."""
    progress: bool = True
    """Draw the progress bar (GB/s) on a terminal."""
    on_file: Callable[[str], None] | None = None
    """Called with each file's name once it is complete (tests stop a conversion here)."""


def convert(source: Path, out: Path, options: ConvertOptions) -> Path:
    """Converts the checkpoint directory `source` into `out`; returns `out` (see module doc)."""
    checkpoint = Checkpoint.open(source)
    plan = plan_convert(checkpoint, options.weight_format, options.group_size)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"source": str(source.resolve()), "format": plan.weight_format,
                "group_size": plan.group_size}
    if (out / MANIFEST).is_file():
        _check_same(out / MANIFEST, settings, json.loads((out / MANIFEST).read_text())["settings"])
        return out
    state = _read_state(out, settings)
    done = state["files"]
    check_disk(out, sum(size for name, size in plan.file_sizes().items()
                        if not _complete(out, name, done)))
    with byte_progress(sum(plan.file_sizes().values()), f"converting {source.name}",
                       options.progress) as advance:
        for layer in plan.layers:
            _write_once(out, layer.file, done, state, options,
                        functools.partial(_write_layer, plan, layer, advance=advance))
        _write_once(out, WEIGHTS_FILE, done, state, options,
                    functools.partial(_write_weights, plan, advance=advance))
    config = json.loads((source / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:  # FP8 weights are stored
        config["dtype"] = str(plan.dtype).removeprefix("torch.")  # dequantized in this dtype,
        # which "auto" must load them in again
    _write_once(out, "config.json", done, state, options,
                lambda f: f.write(json.dumps(config, indent=2).encode() + b"\n"))
    for name in copied_files(source):
        data = (source / name).read_bytes()
        _write_once(out, name, done, state, options, functools.partial(_write_bytes, data))
    _write_json(out / MANIFEST, _manifest(plan, settings, done))
    (out / STATE).unlink()
    return out


def check_disk(out: Path, needed: int) -> None:
    """Refuses a conversion whose remaining `needed` bytes do not fit `out`'s file system."""
    free = shutil.disk_usage(out).free
    if needed + _SLACK > free:
        raise CheckpointError(
            f"{out}: the conversion needs {needed / 1e9:.2f} GB more on disk ({needed} bytes), "
            f"the file system has {free / 1e9:.2f} GB free")


def _manifest(plan: ConvertPlan, settings: dict[str, Any],
              done: dict[str, Any]) -> dict[str, Any]:
    layers = [{"module": layer.module, "file": layer.file, "num_experts": layer.shape[0],
               "hidden": layer.shape[1], "intermediate": layer.shape[2],
               "groups": list(layer.groups)} for layer in plan.layers]
    return {"format": FORMAT, "version": VERSION,
            "family": plan.checkpoint.family.model_type, "settings": settings,
            "experts": {"format": plan.weight_format, "group_size": plan.group_size,
                        "numa_groups": len(plan.layers[0].groups) if plan.layers else 0,
                        "packed_bytes": plan.packed_bytes},
            "weights_bytes": plan.weights_bytes, "layers": layers, "files": done}


def _write_layer(plan: ConvertPlan, layer: LayerPlan, f: Any, *,
                 advance: Callable[[int], None]) -> None:
    """Packs the layer's experts exactly as loading the checkpoint would, then writes each
    NUMA group's mapping at its offset."""
    spec = ExpertSpec(*layer.shape, activation=layer.activation)
    experts = CpuExperts(spec, torch.device("cpu"), plan.dtype, plan.weight_format,
                         plan.group_size)
    prefix = len(layer.module) + 1
    for item in layer.tensors:
        value = plan.checkpoint.owner_tensor(item, plan.dtype, experts.keeps_fp8)
        experts.load_tensor(item.name[prefix:], value)
    missing = experts.missing()
    if missing:
        raise CheckpointError(f"{plan.checkpoint.path}: layer {layer.module!r} lacks "
                              f"{len(missing)} expert tensors: {', '.join(missing[:5])}")
    for part, group in zip(experts.moe.packed_groups(), layer.groups, strict=True):
        f.seek(group["offset"])
        f.write(host_tensor(part).numpy().data)
        advance(part.bytes)
    f.truncate(layer.file_bytes)


def _write_weights(plan: ConvertPlan, f: Any, *, advance: Callable[[int], None]) -> None:
    """The non-expert safetensors file, one tensor in memory at a time."""
    f.write(plan.header)
    advance(len(plan.header))
    for item, dtype in plan.weights:
        value = plan.checkpoint.tensor(item, dtype).contiguous()
        data = value.reshape(-1).view(torch.uint8) if value.numel() else value.view(torch.uint8)
        f.write(data.numpy().data)
        advance(value.numel() * value.element_size())


def _write_bytes(data: bytes, f: Any) -> None:
    f.write(data)


def _write_once(out: Path, name: str, done: dict[str, Any], state: dict[str, Any],
                options: ConvertOptions, write: Callable[[Any], Any]) -> None:
    if _complete(out, name, done):
        return
    target = out / name
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    with open(part, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, target)
    done[name] = file_record(target)
    _write_json(out / STATE, state)
    if options.on_file is not None:
        options.on_file(name)


def _complete(out: Path, name: str, done: dict[str, Any]) -> bool:
    record = done.get(name)
    target = out / name
    return record is not None and target.is_file() and target.stat().st_size == record["bytes"]


def _read_state(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    path = out / STATE
    if not path.is_file():
        if any(p.name not in ("experts", ".gguf-source") and not p.name.endswith(".part")
               for p in out.iterdir()):
            raise CheckpointError(f"{out}: exists and holds files of something else than a "
                                  "conversion; choose an empty or new directory")
        return {"settings": settings, "files": {}}
    state = json.loads(path.read_text())
    _check_same(path, settings, state["settings"])
    return dict(state)


def _check_same(path: Path, settings: dict[str, Any], found: dict[str, Any]) -> None:
    if found != settings:
        raise CheckpointError(f"{path}: this directory holds a conversion with other settings "
                              f"({found}); asked for {settings}; use another directory")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(part, path)
