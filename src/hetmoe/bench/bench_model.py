"""A real model file for the benchmarks, loaded as `hetmoe bench MODEL` loads it.

`hetmoe bench MODEL` builds an `LLM` (a GGUF file is converted once into the cache dir, in the
packed format `convert_source.default_format` picks: int8 with 32-wide groups for Q4_0 and Q8_0)
and times its model with a runner of its own. `open_bench_model` does the same; given a weight
format, a GGUF is converted into that format instead (its own directory in the cache dir, keyed
by file, format and group), e.g. Q4_0 into int4 with groups of 32: the same bits per weight and
group as the file, so both engines read the same bytes of the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetmoe.engine.engine import LLM
from hetmoe.loading.convert import ConvertOptions
from hetmoe.loading.convert_source import conversion_dir, convert_source, is_gguf


@dataclass
class BenchModel:
    """The loaded model, its transformers config, and where its experts came from."""

    model: torch.nn.Module
    config: Any
    path: Path
    """The directory that was mapped (a GGUF's conversion)."""
    gguf: Path | None
    """The GGUF file, when one was given."""


def gguf_conversion(path: Path, weight_format: str, group: int | None,
                    progress: bool = False) -> Path:
    """The converted directory of the GGUF at `path` in `weight_format` (made on first use)."""
    out = conversion_dir(path, f"-{weight_format}g{group or 0}")
    return convert_source(path, out, ConvertOptions(weight_format, group, progress))


def open_bench_model(model: str, device: torch.device, weight_format: str | None = None,
                     group: int | None = None) -> BenchModel:
    """`model` (GGUF file, checkpoint or converted directory, preset) loaded as `hetmoe bench`
    loads it, every routed expert on the CPU backend; `weight_format` (and `group`) convert a
    GGUF into that packed format first. ValueError for a format asked of anything else."""
    path = Path(model)
    gguf = path if is_gguf(path) else None
    if weight_format is not None:
        if gguf is None:
            raise ValueError(f"{model}: a weight format applies to a GGUF file (converted into "
                             "it); convert a checkpoint with `hetmoe convert --experts FMT` and "
                             "pass the converted directory")
        path = gguf_conversion(gguf, weight_format, group)
    llm = LLM(str(path), device=device, progress=False, gpu_expert_bytes=0)
    return BenchModel(llm.model, llm.model.config, path, gguf)
