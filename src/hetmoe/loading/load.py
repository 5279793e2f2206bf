"""`load_model`: a checkpoint directory to a ready model, with injection between skeleton and data.

    loaded = load_model(path, device="cpu", dtype=torch.bfloat16, inject=apply_rules)

runs `Checkpoint.open(path)` → `build_skeleton(config, dtype)` (meta) → `inject(model)` (replace
modules before any weight is read; its return value becomes `inject_report`) → `materialize(...)`
(each tensor streamed once to its owner) → `model.eval()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer

from hetmoe.loading.checkpoint import Checkpoint
from hetmoe.loading.materialize import materialize
from hetmoe.loading.skeleton import build_skeleton

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the engine needs beside it."""

    model: nn.Module
    """The HF causal-LM module (injected modules in place), in eval mode."""
    config: Any
    """Its transformers config (`scoring_func`/`topk_method` filled in for DeepSeek)."""
    tokenizer: Any | None
    """`AutoTokenizer` of the directory, None when it holds no tokenizer files."""
    family: str
    """`model_type`: qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3 or mixtral."""
    inject_report: Any
    """What `inject` returned (None without injection)."""


def load_model(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    inject: Callable[[nn.Module], Any] | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Loads the checkpoint directory `path` onto `device`.

    `dtype` defaults to the config's `dtype` (bfloat16 for FP8 checkpoints, which are
    dequantized). `inject` receives the meta skeleton and may replace modules; replacements that
    define `load_tensor(name, tensor)` receive their tensors, and a `device` instance attribute
    places the parameters below them.
    """
    checkpoint = Checkpoint.open(path)
    dtype = dtype or _config_dtype(checkpoint)
    model = build_skeleton(checkpoint.config, dtype)
    report = inject(model) if inject is not None else None
    materialize(model, checkpoint, device=device, dtype=dtype, progress=progress)
    model.eval()
    return LoadedModel(model, checkpoint.config, load_tokenizer(checkpoint.path),
                       checkpoint.family.model_type, report)


def _config_dtype(checkpoint: Checkpoint) -> torch.dtype:
    value = getattr(checkpoint.config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if checkpoint.fp8 is not None or not isinstance(value, torch.dtype):
        return torch.bfloat16
    return value


def load_tokenizer(path: Path) -> Any | None:
    """The `AutoTokenizer` of the checkpoint directory `path`, None when it holds no tokenizer
    files (also read before the weights: `hetmoe batch` sizes its job by its tokens)."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        log.info("%s has no tokenizer files; text in and out is unavailable", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))
