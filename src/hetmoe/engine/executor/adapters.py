"""LoRA adapters served without merging: `LoraAdapters` loads PEFT adapters (by name) into the
injected model's GPU modules through peft's LoRA layers; each forward of the runner says which
adapter each batch row uses, so one decode step mixes requests of different adapters.

Per row, peft's mixed-batch path (`adapter_names`, `__base__` = no adapter) adds each adapter's
B A x to its own rows only. The runner knows slots, not requests: the scheduler assigns each
slot its request's adapter when it allocates the slot (`assign`), and `rows(slots)` passes the
slots' names to every LoRA layer for the forward inside it. The fused decode functions and CUDA
graphs read raw weights and bake in one step's row assignment, so `LLM` turns both off when
adapters are loaded (the HF layers run eagerly), and the prefix cache too (a slot's KV depends
on its adapter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from hetmoe.config import EngineConfig
from hetmoe.train.lora import peft_wrapping

BASE = "__base__"
"""peft's adapter name for rows that run the base model."""


LoraSpec = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]
"""`LLM(lora=...)`: one adapter directory, or {name: directory}."""


def parse_lora(spec: LoraSpec) -> dict[str, Path]:
    """{name: directory} from `LLM(lora=...)`: one path (named by its directory) or a mapping;
    FileNotFoundError for a directory without `adapter_config.json`."""
    if isinstance(spec, Mapping):
        named = {str(k): Path(v) for k, v in spec.items()}
    else:
        path = Path(spec)
        named = {path.resolve().name: path}
    for name, path in named.items():
        if not (path / "adapter_config.json").is_file():
            raise FileNotFoundError(f"LoRA adapter {name!r}: {path} has no adapter_config.json "
                                    "(expected a PEFT adapter directory, e.g. `hetmoe sft --out`)")
        if name == BASE or not name:
            raise ValueError(f"LoRA adapter name {name!r} is reserved or empty")
    return named


class LoraAdapters:
    """Named PEFT adapters attached to a loaded model, selected per KV slot."""

    def __init__(self, model: nn.Module, adapters: Mapping[str, Path],
                 default: str | None = None) -> None:
        # peft takes seconds to import: only when adapters are served
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        items = list(adapters.items())
        if not items:
            raise ValueError("LoraAdapters needs at least one adapter")
        first, path = items[0]
        with peft_wrapping():  # peft reads a deprecated transformers property
            self.peft: Any = PeftModel.from_pretrained(model, str(path), adapter_name=first)
        for name, path in items[1:]:
            self.peft.load_adapter(str(path), adapter_name=name)
        self.peft.eval()
        self.names = tuple(name for name, _ in items)
        """The loaded adapters' names, in the order given."""
        self.default = default
        """The adapter of requests that name none (`LLM(lora=PATH)`); None: the base model."""
        self._layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        self._slots: dict[int, str] = {}

    @classmethod
    def load(cls, model: nn.Module, adapters: Mapping[str, Path] | None,
             spec: LoraSpec | None) -> LoraAdapters | None:
        """The adapters of `with_lora` on `model` (None: none); one path is the default."""
        if adapters is None:
            return None
        return cls(model, adapters, None if isinstance(spec, Mapping) else next(iter(adapters)))

    def assign(self, slot: int, name: str | None) -> None:
        """`slot`'s rows use adapter `name` from now on (None: the default adapter, if any,
        else the base model; `BASE`: the base model)."""
        if name is not None and name != BASE and name not in self.names:
            raise ValueError(f"no LoRA adapter named {name!r}; loaded: {', '.join(self.names)}")
        self._slots[slot] = name or self.default or BASE

    def release(self, slot: int) -> None:
        """`slot` runs the base model again (it was freed)."""
        self._slots.pop(slot, None)

    @contextlib.contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """Inside, a forward whose batch row b belongs to slots[b] uses that slot's adapter."""
        names = [self._slots.get(s, BASE) for s in slots]

        def pass_names(_: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return args, {**kwargs, "adapter_names": names}

        handles = [m.register_forward_pre_hook(pass_names, with_kwargs=True)
                   for m in self._layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def with_lora(options: EngineConfig,
              lora: LoraSpec | None) -> tuple[EngineConfig, dict[str, Path] | None]:
    """`options` and the named adapters of `lora`; with adapters, no fused decode, CUDA graphs
    or prefix cache (see the module docstring). Checked before the model loads."""
    if lora is None:
        return options, None
    return dataclasses.replace(options, fused_decode=False, cuda_graphs=False,
                               prefix_cache=False), parse_lora(lora)


def assign_adapter(runner: Any, slot: int, name: str | None) -> None:
    """Gives a newly allocated slot of `runner` its request's adapter; ValueError for an adapter
    on a model loaded without adapters."""
    if runner.adapters is not None:
        runner.adapters.assign(slot, name)
    elif name is not None:
        raise ValueError(f"LoRA adapter {name!r} requested, but the model was loaded without "
                         "adapters (LLM(lora=...), --lora)")
