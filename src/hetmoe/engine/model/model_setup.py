"""What `LLM` reads and checks while it loads a model: config, dtype, device, EOS ids, experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hetmoe.experts.backend import ExpertBackend
from hetmoe.experts.cpu_backend import CpuExperts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    """cuda when a GPU is visible, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None) -> torch.device:
    """The device to run on; ValueError, before any loading, for one torch does not know, one
    hetmoe does not run on, or a GPU that is not there."""
    if device is None:
        return default_device()
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {str(device)!r} is not a device name torch knows; use cpu, "
                         "cuda or cuda:N") from None
    if chosen.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r}: hetmoe runs on cpu or cuda[:N]")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but no CUDA GPU is available")
    return chosen


def check_experts_loaded(model: torch.nn.Module, path: Path) -> None:
    """Every routed expert must have received its three matrices from the checkpoint."""
    missing = [
        f"{name}.{tensor}"
        for name, module in model.named_modules()
        if isinstance(module, ExpertBackend)
        for tensor in module.missing()
    ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"{path}: the checkpoint lacks {len(missing)} routed-expert tensors: "
            f"{', '.join(missing[:5])}{more}"
        )


def share_cores(model: torch.nn.Module, device: torch.device, requested: int | None) -> None:
    """On the CPU device, gives torch the cores the CPU expert pool leaves free.

    The pool's workers spin between layers, so torch threads on the same cores would be
    preempted by them and every torch op would wait for its slowest thread.
    """
    if device.type != "cpu" or not any(isinstance(m, CpuExperts) for m in model.modules()):
        return
    if requested is None:
        from hetmoe._cpu import pool_info  # present: CpuExperts are loaded

        info = pool_info()
        requested = max(1, int(info["allowed_cpus"]) - int(info["threads"]))
    torch.set_num_threads(requested)


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    try:
        return json.loads(config_path.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"{config_path}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path}: not valid JSON: {exc}") from exc


def resolve_dtype(option: str, raw: dict[str, Any]) -> torch.dtype:
    if option != "auto":
        return DTYPES[option]
    if (raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        return torch.bfloat16  # FP8 weights are dequantized at load, to bf16 by default
    stored = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return DTYPES.get(str(stored), torch.float32)


GENERATION_CONFIG = "generation_config.json"


def generation_config(path: Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json ({} without one); invalid JSON is named."""
    generation = path / GENERATION_CONFIG
    if not generation.exists():
        return {}
    try:
        raw = json.loads(generation.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{generation}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{generation}: expected a JSON object, found {type(raw).__name__}")
    return raw


def eos_ids(path: Path, config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources = [config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
    sources.append(generation_config(path).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling the checkpoint's `generation_config.json` recommends (temperature, top_p,
    top_k; `do_sample: false` means greedy), as far as it says; {} without the file. A bad file
    is named, not skipped."""
    generation = path / GENERATION_CONFIG
    raw = generation_config(path)
    if raw.get("do_sample") is False:
        return {"temperature": 0.0}
    out: dict[str, float | int] = {}
    for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
        value = raw.get(key)
        if value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{generation}: field {key!r} must be a number, got {value!r}")
            out[key] = kind(value)
    return out
