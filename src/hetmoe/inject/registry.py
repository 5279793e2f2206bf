"""Registry of injectable operators: the only things a rule's `replace.op` may name.

An operator is a factory `build(module, device, options, ctx) -> nn.Module` that turns the HF
module a rule matched (still on `meta`) into ours, plus a frozen dataclass of its `kwargs`.
Rules never name import paths, so a rule file cannot run arbitrary code.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetmoe.experts.fp8_weight import Fp8Scheme

# Modules whose import registers the shipped operators; imported on first lookup.
_OP_MODULES = ("hetmoe.ops.moe", "hetmoe.ops.attention", "hetmoe.ops.mla")


@dataclass(frozen=True)
class OpContext:
    """What every operator factory may need beyond its own kwargs."""

    main_device: torch.device
    """The engine's device (`device: main` in rules)."""
    dtype: torch.dtype
    """Dtype of weights and activations."""
    config: Any
    """The model's HF `PretrainedConfig`."""
    experts: str | None = None
    """Engine-wide routed-expert backend override (EngineConfig.experts)."""
    fp8: Fp8Scheme | None = None
    """The checkpoint's FP8 block scaling when its weights are FP8 (cpu experts then default to
    the fp8 format)."""


OpFactory = Callable[[nn.Module, torch.device, Any, OpContext], nn.Module]


@dataclass(frozen=True)
class OpSpec:
    """A registered operator: its name, its kwargs dataclass and its factory."""

    name: str
    """The name rule files use in `replace.op`."""
    options: type
    """Frozen dataclass of the operator's `kwargs`; unknown keys are rejected at parse time."""
    build: OpFactory
    """Builds the replacement module from the matched one."""


_OPS: dict[str, OpSpec] = {}


def register_op(name: str, options: type) -> Callable[[OpFactory], OpFactory]:
    """Decorator registering `build` as operator `name` with kwargs dataclass `options`."""

    def wrap(build: OpFactory) -> OpFactory:
        if name in _OPS:
            raise ValueError(f"operator {name!r} is registered twice")
        _OPS[name] = OpSpec(name, options, build)
        return build

    return wrap


def _ensure_loaded() -> None:
    for module in _OP_MODULES:
        importlib.import_module(module)


def get_op(name: str) -> OpSpec | None:
    """The operator registered as `name`, or None."""
    _ensure_loaded()
    return _OPS.get(name)


def op_names() -> list[str]:
    """Names of all registered operators, sorted."""
    _ensure_loaded()
    return sorted(_OPS)


def make_options(spec: OpSpec, kwargs: dict[str, Any]) -> Any:
    """Builds `spec.options` from a rule's kwargs; raises ValueError naming the bad key."""
    known = {f.name: f for f in dataclasses.fields(spec.options)}
    for key, value in kwargs.items():
        field = known.get(key)
        if field is None:
            raise ValueError(
                f"unknown kwarg {key!r} for op {spec.name!r} (known: {', '.join(known) or 'none'})"
            )
        expected = field.type if isinstance(field.type, str) else field.type.__name__
        if not _type_ok(value, expected):
            raise ValueError(
                f"kwarg {key!r} of op {spec.name!r} must be {expected}, got {value!r}"
            )
    return spec.options(**kwargs)


def _type_ok(value: Any, expected: str) -> bool:
    # Options use plain scalar annotations (`str`, `int`, `bool`, `str | None`, ...).
    allowed = {part.strip() for part in expected.split("|")}
    name = "None" if value is None else type(value).__name__
    return name in allowed or (name == "int" and "float" in allowed)
