"""What `LLM` does with its model argument before loading: GGUF files converted once into the
cache, converted directories checked, and the memory plan checked against this machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import hetmoe.presets
from hetmoe.loading.convert import STATE
from hetmoe.loading.convert_source import cached_conversion, is_gguf
from hetmoe.loading.converted import MANIFEST, ConvertedModel, is_converted, open_converted
from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.hub import fetch_named
from hetmoe.loading.hub_cache import hub_conversion
from hetmoe.loading.memory_plan import MemoryPlan, memory_plan

DEFAULT_MAX_SEQ_LEN = 4096


def open_model(model: str | os.PathLike[str], verify: bool, progress: bool,
               experts: str | None = None) -> tuple[Path, ConvertedModel | None]:
    """The checkpoint directory of `model` (a GGUF file or Hub model becomes its cached
    conversion; a Hub name is fetched into the HF cache first) and, for a converted directory,
    its checked manifest (`verify`: full checksums too). Bad files
    are refused here, before any GPU work; so is an expert backend other than `cpu` for a
    GGUF file or a converted model (their experts exist only in its packed layout)."""
    # a Hub name: its files in the HF cache
    hub = None if str(model) in hetmoe.presets.presets() else fetch_named(model, progress=progress)
    path = hetmoe.presets.resolve_model(model) if hub is None else hub.path
    gguf = is_gguf(path)
    if (gguf or is_converted(path)) and experts not in (None, "cpu"):
        raise ValueError(
            f"{path}: a {'GGUF file' if gguf else 'converted model'} serves its routed "
            f"experts from the cpu backend's packed layout, not experts={experts!r}; for other "
            "backends load a checkpoint directory (hetmoe.loading.gguf_checkpoint"
            ".write_checkpoint writes one from a GGUF)")
    if hub is not None and experts in (None, "cpu"):
        path = hub_conversion(hub, progress=progress)  # per repo + commit + format, made once
    elif gguf:
        path = cached_conversion(path, progress)
    if (path / STATE).is_file() and not is_converted(path):
        raise CheckpointError(f"{path}: an unfinished conversion (no {MANIFEST} yet); run "
                              "`hetmoe convert` with the same arguments again to finish it")
    return path, open_converted(path, verify) if is_converted(path) else None


def default_window(config: Any) -> int:
    """The context window a sequence gets unless asked: the model's, capped at
    DEFAULT_MAX_SEQ_LEN (EngineConfig.max_seq_len None)."""
    return min(int(getattr(config, "max_position_embeddings", DEFAULT_MAX_SEQ_LEN)),
               DEFAULT_MAX_SEQ_LEN)


def skeleton_plan(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                  converted: ConvertedModel | None, kv_tokens: int = 0) -> MemoryPlan:
    """The memory plan of the injected meta skeleton `model` on `device` with a KV cache of
    `kv_tokens` (converted experts in their packed format)."""
    fmt = converted.weight_format if converted is not None else None
    group = converted.group_size if converted is not None else None
    return memory_plan(model, device, dtype, model.config, kv_tokens, fmt, group)


def check_fits(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
               options: Any, converted: ConvertedModel | None) -> None:
    """Refuses, before any weight is read, a model whose memory plan exceeds what this machine
    has free (the numbers in the message); converted experts count in their packed format."""
    window = options.max_seq_len or default_window(model.config)
    plan = skeleton_plan(model, device, dtype, converted, options.max_batch * window)
    refusal = plan.refusal()
    if refusal:
        raise ValueError(refusal)
