"""The `ExpertBackend` interface for routed experts, and the registry of backends by name.

A backend owns the routed experts of one MoE layer. It is an `nn.Module` sitting at the HF path
of the experts (`model.layers.N.mlp.experts`), so the loader hands it every checkpoint tensor below
that path through `load_tensor`:

- per expert: `E.gate_proj.weight [I, H]`, `E.up_proj.weight [I, H]`, `E.down_proj.weight [H, I]`
  (the loader renames Mixtral's w1/w3/w2 to these);
- or fused, as transformers keeps them in memory: `gate_up_proj [E, 2I, H]` (gate rows first) and
  `down_proj [E, H, I]`.

The base class checks names and shapes, gathers an expert's three matrices and calls
`load_expert(e, gate, up, down)` once all three are there. Subclasses implement `load_expert` and
`forward`; `submit`/`sync` default to a synchronous `forward` and exist so that a backend running
on another device can overlap with the caller's work.
"""

from __future__ import annotations

import importlib
import re
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetmoe.experts.fp8_weight import Fp8Weight

# Modules whose import registers the shipped backends.
_BACKEND_MODULES = ("hetmoe.experts.torch_backend", "hetmoe.experts.cpu_backend")
_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ExpertSpec:
    """Shape of one layer's routed experts."""

    num_experts: int
    """Routed experts in the layer (E)."""
    hidden_size: int
    """Model width (H)."""
    intermediate_size: int
    """Width of one expert's gate/up projections (I)."""
    activation: str = "silu"
    """HF `hidden_act` name applied to the gate projection."""


class ExpertBackend(nn.Module, metaclass=ABCMeta):
    """Routed experts of one MoE layer: `forward(x, expert_ids, expert_weights) -> [T, H]`."""

    def __init__(
        self,
        spec: ExpertSpec,
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str | None = None,
    ) -> None:
        """Experts of shape `spec` for activations of `dtype`; `weight_format` as the backend
        supports (None: its native one)."""
        super().__init__()
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self._parts: dict[int, dict[str, torch.Tensor | Fp8Weight]] = {}
        self._loaded: set[int] = set()
        self._pending: torch.Tensor | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""
        return None

    @abstractmethod
    def load_expert(
        self, expert: int, gate: Any, up: Any, down: Any
    ) -> None:
        """Takes one expert's weights: gate [I, H], up [I, H], down [H, I] (any float dtype;
        `Fp8Weight`s for a backend that `keeps_fp8`)."""

    @abstractmethod
    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ_k w[t,k] · down_e(act(gate_e x_t) ⊙ up_e x_t) with e = ids[t,k].

        x [T, H] on `self.device`; expert_ids [T, K] int64, -1 = skip; expert_weights [T, K]
        float32. Returns [T, H] in x's dtype.
        """

    def submit(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> None:
        """Starts `forward` on the inputs; the result is taken by the next `sync`."""
        if self._pending is not None:
            raise RuntimeError("ExpertBackend.submit called twice without sync")
        self._pending = self.forward(x, expert_ids, expert_weights)

    def sync(self) -> torch.Tensor:
        """Waits for the submitted work and returns its [T, H] output."""
        if self._pending is None:
            raise RuntimeError("ExpertBackend.sync called without submit")
        out, self._pending = self._pending, None
        return out

    def discard(self) -> None:
        """Drops a submitted call's result, if any (a step that failed between submit and sync:
        the next submit must find none pending)."""
        self._pending = None

    keeps_fp8 = False
    """Whether FP8 checkpoint weights arrive as stored (`Fp8Weight`) instead of dequantized."""

    def load_tensor(self, name: str, tensor: torch.Tensor | Fp8Weight) -> None:
        """Receives one checkpoint tensor named relative to this module (see the module doc)."""
        spec = self.spec
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        if name in ("gate_up_proj", "down_proj"):
            if isinstance(tensor, Fp8Weight):
                raise ValueError(f"expert tensor {name!r}: fused FP8 experts are not supported; "
                                 "FP8 checkpoints store experts one by one")
            expected = (e, 2 * i, h) if name == "gate_up_proj" else (e, h, i)
            self._check_shape(name, tensor, expected)
            for expert in range(e):
                if name == "gate_up_proj":
                    self._add_part(expert, "gate_proj", tensor[expert, :i])
                    self._add_part(expert, "up_proj", tensor[expert, i:])
                else:
                    self._add_part(expert, "down_proj", tensor[expert])
            return
        found = _PER_EXPERT.match(name)
        if found is None:
            raise ValueError(
                f"expert backend got tensor {name!r}; expected `E.gate_proj.weight`, "
                "`E.up_proj.weight`, `E.down_proj.weight`, `gate_up_proj` or `down_proj`"
            )
        expert, part = int(found.group(1)), found.group(2)
        if expert >= e:
            raise ValueError(f"tensor {name!r}: expert {expert} out of range (layer has {e})")
        self._check_shape(name, tensor, (h, i) if part == "down_proj" else (i, h))
        self._add_part(expert, part, tensor)

    def missing(self) -> list[str]:
        """Names of expert tensors not received yet (empty once every expert is loaded)."""
        out = []
        for expert in range(self.spec.num_experts):
            if expert not in self._loaded:
                have = self._parts.get(expert, {})
                out += [f"{expert}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
                        if p not in have]
        return out

    def mark_loaded(self) -> None:
        """Every expert is in place (e.g. mapped from a converted model's layer file)."""
        self._parts.clear()
        self._loaded = set(range(self.spec.num_experts))

    def _add_part(self, expert: int, part: str, tensor: torch.Tensor | Fp8Weight) -> None:
        parts = self._parts.setdefault(expert, {})
        parts[part] = tensor
        if len(parts) == 3:
            del self._parts[expert]
            self.load_expert(expert, parts["gate_proj"], parts["up_proj"], parts["down_proj"])
            self._loaded.add(expert)

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor | Fp8Weight,
                     expected: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"expert tensor {name!r}: expected shape {list(expected)}, "
                f"found {list(tensor.shape)}"
            )
        if isinstance(tensor, Fp8Weight):
            return
        if not tensor.is_floating_point():
            raise ValueError(f"expert tensor {name!r}: expected floats, found {tensor.dtype}")


_BACKENDS: dict[str, type[ExpertBackend]] = {}


def register_backend(name: str) -> Callable[[type[ExpertBackend]], type[ExpertBackend]]:
    """Class decorator registering an expert backend under `name`."""

    def wrap(cls: type[ExpertBackend]) -> type[ExpertBackend]:
        if name in _BACKENDS:
            raise ValueError(f"expert backend {name!r} is registered twice")
        _BACKENDS[name] = cls
        return cls

    return wrap


def backends() -> dict[str, type[ExpertBackend]]:
    """Registered backends by name (those whose dependencies are importable)."""
    for module in _BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return dict(_BACKENDS)


def get_backend(name: str) -> type[ExpertBackend]:
    """The backend class registered as `name`; ValueError if unknown or unable to run here."""
    table = backends()
    if name not in table:
        raise ValueError(f"unknown expert backend {name!r} (known: {', '.join(sorted(table))})")
    reason = table[name].unavailable()
    if reason is not None:
        raise ValueError(f"expert backend {name!r} cannot run here: {reason}")
    return table[name]
