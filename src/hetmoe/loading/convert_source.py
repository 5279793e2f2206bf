"""What `convert` and `LLM` accept as a model: a checkpoint directory, a preset, or a GGUF file.

A GGUF file is first written as a float32 HF checkpoint (`gguf_checkpoint.write_checkpoint`,
exact for every quant type the `gguf` package dequantizes) in `OUT/.gguf-source`, converted from
there, and the staging removed. `LLM("model.gguf")` converts once into the hetmoe cache dir
(`cached_conversion`) and then maps that directory like any converted model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

from hetmoe import env
from hetmoe.loading.convert import ConvertOptions, check_disk, convert
from hetmoe.loading.converted import MANIFEST
from hetmoe.loading.fp8 import config_fp8_scheme
from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.gguf_checkpoint import write_checkpoint

STAGING = ".gguf-source"
_LOSSLESS = {"F32": "bf16", "F16": "bf16", "BF16": "bf16"}


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def default_format(path: Path) -> tuple[str, int | None, str]:
    """The packed format for a GGUF's routed experts: (format, group, why). F32/F16/BF16 become
    bf16; Q8_0 int8 in its own 32-wide groups; every other quant type int8 with 32-groups too
    (a re-quantization of 8 bits over a grid of 6 or fewer: the smallest loss on offer)."""
    g = open_gguf(path)
    types = sorted({t.tensor_type.name for t in g.reader.tensors if "_exps" in t.name
                    or ".ffn_gate." in t.name})
    if types and all(t in _LOSSLESS for t in types):
        return "bf16", None, f"{'/'.join(types)} experts: bf16 keeps them"
    if types == ["Q8_0"]:
        return "int8", 32, "Q8_0 experts: int8 with 32-wide groups, the same grid"
    return "int8", 32, f"{'/'.join(types)} experts: int8 with 32-wide groups, nearest on offer"


def checkpoint_format(path: Path, group: int | None) -> tuple[str, int | None, str]:
    """The packed format for a checkpoint directory's experts when none is asked: what a direct
    load picks (`Fp8Scheme.cpu_expert_format`: fp8 for an FP8 checkpoint whose blocks are whole
    32-column groups, its e4m3 codes and block scales kept as stored), else bf16."""
    config = path / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    scheme = config_fp8_scheme(raw, str(config))
    fmt, fp8_group = scheme.cpu_expert_format(None) if scheme else (None, None)
    if fmt is None:
        return "bf16", group, "the default"
    return fmt, group or fp8_group, "an FP8 checkpoint: its codes and scales as stored"


def convert_source(path: Path, out: Path, options: ConvertOptions) -> Path:
    """Converts the checkpoint directory or GGUF file at `path` (a preset or Hub name resolved
    by the caller: `presets.resolve_model`) into `out`; returns `out`."""
    if not is_gguf(path):
        return convert(path, out, options)
    if (out / MANIFEST).is_file():
        return out
    staging = out / STAGING
    if not (staging / ".complete").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        check_disk(out, 2 * staging_bytes(path))
        write_checkpoint(path, staging, progress=options.progress)
        (staging / ".complete").touch()
    convert(staging, out, options)
    shutil.rmtree(staging)
    return out


def staging_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors in float32 (the staging checkpoint)."""
    return sum(int(t.n_elements) * 4 for t in open_gguf(path).reader.tensors)


def conversion_dir(path: Path, tag: str = "") -> Path:
    """Where the cache keeps the conversion of the GGUF at `path` (its name, `tag`, and a key of
    its resolved path, size and modification time: a changed file converts again)."""
    stat = path.stat()
    key = hashlib.blake2b(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode(),
                          digest_size=6).hexdigest()
    return env.cache_dir() / "converted" / f"{path.stem}{tag}-{key}"


def cached_conversion(path: Path, progress: bool = True) -> Path:
    """The converted directory of the GGUF at `path` in the cache dir, converted on first use
    (in the format `default_format` picks, said on stderr)."""
    out = conversion_dir(path)
    if (out / MANIFEST).is_file():
        return out
    fmt, group, why = default_format(path)
    print(f"hetmoe: converting {path.name} into {out} with {fmt} experts"
          f"{f', group {group}' if group else ''} ({why}); first use only",
          file=sys.stderr, flush=True)
    return convert_source(path, out, ConvertOptions(fmt, group, progress))
