"""Checkpoint readers, per-family name maps, meta skeletons and streaming materialization.

Public API (stable; the engine and injection build on it):
- `load_model(path, *, device="cpu", dtype=None, inject=None, progress=True) -> LoadedModel`
- `LoadedModel(model, config, tokenizer, family, inject_report)` (frozen)
- `Checkpoint.open(path)`, `build_skeleton(config, dtype)`,
  `materialize(model, checkpoint, *, device, dtype, progress=True)`
- `TensorOwner`: the `load_tensor(name, tensor)` protocol of modules that take their own tensors
- `CheckpointError` for every problem of a checkpoint; `FAMILIES` the supported `model_type`s.
"""

from __future__ import annotations

from hetmoe.loading.checkpoint import Checkpoint, CheckpointTensor
from hetmoe.loading.errors import CheckpointError
from hetmoe.loading.families import FAMILIES, Family
from hetmoe.loading.load import LoadedModel, load_model
from hetmoe.loading.materialize import TensorOwner, materialize
from hetmoe.loading.skeleton import build_skeleton

__all__ = [
    "FAMILIES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointTensor",
    "Family",
    "LoadedModel",
    "TensorOwner",
    "build_skeleton",
    "load_model",
    "materialize",
]
