"""Built-in model names: built deterministically into the cache dir on first use, then reused.

A preset is a function that writes a HF-style checkpoint directory (config.json, safetensors,
tokenizer files). `resolve_model(name_or_path)` turns a CLI/engine MODEL argument into a directory.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetmoe import env
from hetmoe.loading.gguf_check import check_magic
from hetmoe.loading.hub import fetch_named

# Modules that register presets when imported; kept lazy so that a path argument imports nothing.
_PRESET_MODULES = ("hetmoe.presets.tiny", "hetmoe.presets.demo", "hetmoe.presets.demo_moe")


@dataclass(frozen=True)
class Preset:
    name: str
    """The built-in model name users type (e.g. `tiny-qwen3-moe`)."""
    description: str
    """One line for `--help` and error messages."""
    build: Callable[[Path], None]
    """Writes the checkpoint into an empty directory."""
    version: int = 1
    """Bumped when the builder's output changes, so stale caches are rebuilt."""


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Adds a preset to the registry (names are unique)."""
    if preset.name in _PRESETS:
        raise ValueError(f"preset {preset.name!r} is registered twice")
    _PRESETS[preset.name] = preset
    return preset


def presets() -> dict[str, Preset]:
    """All registered presets by name."""
    for module in _PRESET_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a preset module that exists but lacks its own dependency
                raise
    return dict(_PRESETS)


def resolve_model(model: str | os.PathLike[str]) -> Path:
    """A checkpoint directory for `model`: an existing path, a preset built on first use, or a
    Hub model's files in the HF cache (fetched on first use)."""
    path = Path(model).expanduser()
    if path.is_file():
        check_magic(path)  # else read as a directory: "junk.gguf/config.json: Not a directory"
    if path.exists():
        return path
    table = presets()
    preset = table.get(str(model))
    if preset is None and path.suffix == ".gguf":
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if preset is None:
        hub = fetch_named(model)  # org/name[@rev], org/name-GGUF[:QUANT]: fetched once
        if hub is not None:
            return hub.path
        names = ", ".join(sorted(table)) or "none"
        raise FileNotFoundError(
            f"model {str(model)!r} is neither an existing directory nor a built-in preset "
            f"(presets: {names}) nor a Hub model name (org/name[@revision], "
            "org/name-GGUF[:QUANT])"
        )
    target = env.cache_dir() / "models" / f"{preset.name}-v{preset.version}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"hetmoe: building preset {preset.name!r} into {target} (first use only)",
          file=sys.stderr, flush=True)
    # Build in a temp dir beside the target and rename: a crash never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset.name}-", dir=target.parent))
    try:
        preset.build(tmp)
        (tmp / ".complete").write_text(preset.name + "\n")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / ".complete").exists():  # not a concurrent builder that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
