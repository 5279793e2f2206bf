"""Streaming materialization: each checkpoint tensor read once, straight to its owner.

For a module-space name, the owner is, in order:
1. the deepest module on the name's path with a `load_tensor(name_relative_to_module, tensor)`
   method (set by injection, e.g. an expert backend receives `3.gate_proj.weight`); it gets a CPU
   tensor, FP8 already dequantized (kept as stored, an `Fp8Weight`, for an owner whose
   `keeps_fp8` is true), floating data in the load dtype;
2. the parameter or buffer of that name, allocated in the skeleton's dtype on the device of the
   nearest module on the path with a `device` attribute (an instance attribute set by injection),
   else the load device;
3. the fused HF experts (`experts.gate_up_proj [E, 2I, H]` gate rows first, `experts.down_proj
   [E, H, I]`) for per-expert `experts.E.{gate,up,down}_proj.weight`: allocated once, filled slice
   by slice.
CPU destinations of the stored dtype are filled by `readinto` directly, without a staging copy.
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from io import FileIO
from typing import Protocol, cast

import torch
from torch import nn

from hetmoe.experts.fp8_weight import Fp8Weight
from hetmoe.loading.checkpoint import Checkpoint, CheckpointTensor
from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.progress import byte_progress
from hetmoe.loading.tensor_file import read_tensor

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(?P<experts>.+)\.(?P<index>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_SHOWN = 5  # names listed in an error before "and N more"


class TensorOwner(Protocol):
    """A module that takes the checkpoint tensors below it itself (e.g. an expert backend)."""

    def load_tensor(self, name: str, tensor: torch.Tensor | Fp8Weight) -> None:
        """Receives `name` (relative to this module, e.g. `3.gate_proj.weight`) once: a CPU tensor,
        FP8 dequantized, floating data in the load dtype; the module may keep it. An owner with
        a true `keeps_fp8` attribute gets FP8 block-scaled weights as stored (`Fp8Weight`)."""


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes."""

    module: nn.Module
    """The receiving module (an owner with `load_tensor`, or the tensor's parent)."""
    name: str
    """Name relative to `module` (for fused experts: the fused parameter's name)."""
    device: torch.device
    """Device of a parameter/buffer destination."""
    expert: int = -1
    """Expert index into a fused parameter, else -1."""
    rows: slice = field(default_factory=lambda: slice(None))
    """Rows of the fused expert slice (gate: first half, up: second half)."""
    path: str = ""
    """Qualified name of the fused experts module (fused slots only)."""
    proj: str = ""
    """`gate`, `up` or `down` (fused slots only)."""


def materialize(
    model: nn.Module,
    checkpoint: Checkpoint,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = True,
) -> None:
    """Streams every tensor of `checkpoint` into `model` (a meta skeleton, maybe injected).

    `dtype` is the floating dtype handed to `load_tensor` owners; parameters keep the skeleton's
    dtypes. Raises `CheckpointError` naming the tensor and file on a wrong shape or dtype, a tensor
    without a place in the model, and the model tensors the checkpoint lacks.
    """
    device = torch.device(device)
    modules = dict(model.named_modules())
    slots = {name: _slot(name, modules, device) for name in checkpoint.tensors}
    homeless = [n for n, s in slots.items() if s is None]
    if homeless:
        raise CheckpointError(
            f"{checkpoint.path}: {len(homeless)} checkpoint tensors have no place in the "
            f"{type(model).__name__} built from its config.json: {_listing(homeless)}"
        )
    ties = _tied_parameters(model)
    fused_filled: dict[str, set[tuple[str, int]]] = {}
    ordered = sorted(checkpoint.tensors.values(), key=lambda t: (str(t.entry.file), t.entry.start))
    with ExitStack() as stack, byte_progress(
        checkpoint.nbytes, f"loading {checkpoint.path.name}", progress
    ) as advance:
        handles = {
            file: stack.enter_context(open(file, "rb", buffering=0))
            for file in {t.entry.file for t in ordered}
        }
        for item in ordered:
            slot = slots[item.name]
            assert slot is not None
            f = handles[item.entry.file]
            if slot.expert >= 0:
                _fill_fused(checkpoint, item, slot, f, fused_filled)
            elif hasattr(slot.module, "load_tensor"):
                keep_fp8 = bool(getattr(slot.module, "keeps_fp8", False))
                value = checkpoint.owner_tensor(item, dtype, keep_fp8, f=f)
                cast(TensorOwner, slot.module).load_tensor(slot.name, value)
            else:
                _fill_tensor(checkpoint, item, slot, f)
            advance(item.entry.nbytes)
    _retie(model, ties)
    rebuild_computed_buffers(model, device)
    missing = _missing_experts(modules, fused_filled) + _still_meta(model)
    if missing:
        raise CheckpointError(
            f"{checkpoint.path}: the checkpoint lacks {len(missing)} tensors the model needs: "
            f"{_listing(missing)}"
        )
    log.debug("materialized %d tensors (%d bytes) from %s", len(ordered), checkpoint.nbytes,
              checkpoint.path)


def _slot(name: str, modules: dict[str, nn.Module], device: torch.device) -> _Slot | None:
    """The destination of `name`, or None when the model has no place for it."""
    parts = name.split(".")
    owner: tuple[nn.Module, str] | None = None
    placed = device
    if "" in modules:
        placed = _device_of(modules[""], placed)
        if hasattr(modules[""], "load_tensor"):
            owner = (modules[""], name)
    for i in range(1, len(parts)):
        module = modules.get(".".join(parts[:i]))
        if module is None:
            break
        placed = _device_of(module, placed)
        if hasattr(module, "load_tensor"):
            owner = (module, ".".join(parts[i:]))
    if owner is not None:
        return _Slot(owner[0], owner[1], placed)
    parent = modules.get(".".join(parts[:-1]))
    if parent is not None and (parts[-1] in parent._parameters or parts[-1] in parent._buffers):
        return _Slot(parent, parts[-1], placed)
    match = _EXPERT.match(name)
    experts = modules.get(match["experts"]) if match else None
    if match is None or experts is None or not _is_fused(experts):
        return None
    half = _fused(experts, "gate_up_proj").shape[1] // 2
    rows = {"gate": slice(0, half), "up": slice(half, 2 * half), "down": slice(None)}[match["proj"]]
    fused = "down_proj" if match["proj"] == "down" else "gate_up_proj"
    return _Slot(experts, fused, placed, int(match["index"]), rows, match["experts"], match["proj"])


def _device_of(module: nn.Module, inherited: torch.device) -> torch.device:
    # Only an instance attribute counts: HF models expose `device` as a property of their weights.
    value = vars(module).get("device")
    return torch.device(value) if isinstance(value, str | torch.device) else inherited


def _fused(module: nn.Module, name: str) -> nn.Parameter:
    param = module._parameters[name]
    assert param is not None
    return param


def _is_fused(module: nn.Module) -> bool:
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    return gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3


def _fill_tensor(checkpoint: Checkpoint, item: CheckpointTensor, slot: _Slot, f: FileIO) -> None:
    """Reads `item` into the parameter/buffer `slot.name` of `slot.module`."""
    found = slot.module._parameters.get(slot.name)
    current = found if found is not None else slot.module._buffers[slot.name]
    assert current is not None  # `_slot` only places names with a tensor behind them
    _check(item, current.shape, current.dtype, f"{type(slot.module).__name__}.{slot.name}")
    dest = current if current.device.type != "meta" else torch.empty(
        current.shape, dtype=current.dtype, device=slot.device
    )
    _read_into(checkpoint, item, dest.data, f)
    if current.device.type == "meta":
        if slot.name in slot.module._parameters:
            slot.module._parameters[slot.name] = nn.Parameter(dest, requires_grad=False)
        else:
            slot.module._buffers[slot.name] = dest


def _fill_fused(
    checkpoint: Checkpoint,
    item: CheckpointTensor,
    slot: _Slot,
    f: FileIO,
    filled: dict[str, set[tuple[str, int]]],
) -> None:
    """Reads one expert's projection into its slice of the fused experts parameter."""
    fused = _fused(slot.module, slot.name)
    if fused.device.type == "meta":  # first expert of this layer: allocate the whole stack once
        fused = nn.Parameter(
            torch.empty(fused.shape, dtype=fused.dtype, device=slot.device), requires_grad=False
        )
        slot.module._parameters[slot.name] = fused
    if slot.expert >= fused.shape[0]:
        raise CheckpointError(
            f"{item.describe()}: expert {slot.expert} does not exist; the model has "
            f"{fused.shape[0]} experts in {slot.name}"
        )
    dest = fused.data[slot.expert, slot.rows]
    target = f"{slot.name}[{slot.expert}] of {type(slot.module).__name__}"
    _check(item, dest.shape, dest.dtype, target)
    _read_into(checkpoint, item, dest, f)
    filled.setdefault(slot.path, set()).add((slot.proj, slot.expert))


def _missing_experts(
    modules: dict[str, nn.Module], filled: dict[str, set[tuple[str, int]]]
) -> list[str]:
    """Per-expert names absent from fused experts that the checkpoint filled only in part."""
    missing = []
    for path, seen in filled.items():
        num_experts = _fused(modules[path], "gate_up_proj").shape[0]
        for e in range(num_experts):
            missing += [f"{path}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")
                        if (p, e) not in seen]
    return missing


def _read_into(
    checkpoint: Checkpoint, item: CheckpointTensor, dest: torch.Tensor, f: FileIO
) -> None:
    """Fills `dest`: by readinto when it is a contiguous CPU tensor of the stored dtype."""
    direct = (
        dest.device.type == "cpu"
        and dest.is_contiguous()
        and item.scale_inv is None
        and item.entry.dtype == dest.dtype
    )
    if direct:
        read_tensor(item.entry, dest, f=f)
    else:  # copy_ converts dtype and device in one pass over a stored-dtype staging tensor
        dest.copy_(checkpoint.tensor(item, f=f))


def _check(item: CheckpointTensor, shape: torch.Size, dtype: torch.dtype, target: str) -> None:
    """Stored shape and dtype must fit the destination (floats convert, other dtypes must match)."""
    stored_dtype = torch.float32 if item.scale_inv is not None else item.entry.dtype
    if tuple(item.shape) != tuple(shape):
        raise CheckpointError(
            f"{item.describe()}: shape {list(item.shape)}, but the model's {target} expects "
            f"{list(shape)}"
        )
    if dtype.is_floating_point != stored_dtype.is_floating_point or (
        not dtype.is_floating_point and stored_dtype != dtype
    ):
        kind = "a floating-point dtype" if dtype.is_floating_point else f"dtype {dtype}"
        raise CheckpointError(
            f"{item.describe()}: dtype {item.entry.dtype}, but the model's {target} expects "
            f"{kind} ({dtype})"
        )


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names sharing one Parameter object (tied embeddings), found before loading."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Points the names of a tied group that the checkpoint did not carry at the one it did.

    A checkpoint holding every name of the group (with their own values) stays untied, as in
    transformers.
    """
    for names in ties:
        params = {n: model.get_parameter(n) for n in names}
        source = next((p for p in params.values() if p.device.type != "meta"), None)
        if source is None:
            continue
        for name, param in params.items():
            if param.device.type == "meta":
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = source


def rebuild_computed_buffers(model: nn.Module, device: torch.device) -> None:
    """Recomputes non-persistent buffers left on meta (rotary `inv_freq`) from the module's config.

    They are computed at construction, never stored; building the module once more on the CPU
    gives the exact values HF computes.
    """
    owners = _owner_names(model)
    for name, module in model.named_modules():
        if _inside(name, owners):
            continue
        pending = [
            b for b, t in module._buffers.items()
            if t is not None and t.device.type == "meta" and b in module._non_persistent_buffers_set
        ]
        if not pending:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise CheckpointError(
                f"buffers {pending} of {name} ({type(module).__name__}) are computed at "
                "construction and the module has no config to rebuild them from"
            )
        with torch.device("cpu"):
            fresh = type(module)(config=config)
        target = _device_of(module, device)
        for buffer in pending:
            module._buffers[buffer] = fresh._buffers[buffer].to(target)


def _still_meta(model: nn.Module) -> list[str]:
    """Names of parameters and persistent buffers still on meta, outside `load_tensor` owners."""
    owners = _owner_names(model)
    return [
        name for name, tensor in model.state_dict(keep_vars=True).items()
        if tensor.device.type == "meta" and not _inside(name, owners)
    ]


def _owner_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, "load_tensor")]


def _inside(name: str, owners: list[str]) -> bool:
    """Whether `name` is an owner or lies under one (owners load their own tensors)."""
    return any(o == "" or name == o or name.startswith(o + ".") for o in owners)


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
