"""Writing a checkpoint's tensors as HF safetensors shards with their index."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_shards(out: Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int) -> None:
    """Safetensors shards of about `shard_bytes` each (one in memory at a time) plus the HF index
    file `model.safetensors.index.json`, written into the directory `out`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    files: list[str] = []
    weight_map: dict[str, str] = {}
    size = total = 0

    def flush() -> None:
        name = f"part-{len(files):05d}.safetensors"
        save_file(shards[0], str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shards[0], name))
        files.append(name)
        shards[0] = {}

    for name, tensor in tensors:
        shards[0][name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            total, size = total + size, 0
            flush()
    if shards[0]:
        total += size
        flush()
    # HF shard names carry the count, known only now.
    count = len(files)
    renames = {f: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renames.items():
        (out / old).rename(out / new)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renames[v] for k, v in sorted(weight_map.items())},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
