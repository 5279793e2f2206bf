"""A safetensors file read by its header offsets, each tensor straight into its destination buffer.

The format is an 8-byte little-endian header length, a JSON header mapping names to dtype, shape and
byte range, then the data. Reading with `readinto` (rather than `safe_open`, which goes through
mmap) keeps file pages out of our resident set: a tensor costs its destination and nothing more.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import torch

from hetmoe.loading.errors import CheckpointError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_MAX_HEADER = 100 << 20  # a larger header is a corrupt file, not a checkpoint
_CHUNK = 1 << 30  # one read() returns at most ~2 GiB on Linux


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    """Name as stored in the file."""
    file: Path
    """The file holding it."""
    dtype: torch.dtype
    """Stored dtype."""
    shape: tuple[int, ...]
    """Stored shape."""
    start: int
    """Absolute byte offset of the data in `file`."""
    end: int
    """Absolute byte offset one past the data."""

    @property
    def nbytes(self) -> int:
        """Size of the stored data."""
        return self.end - self.start


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parses the header of `file` into its tensors, by stored name."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise CheckpointError(f"{file}: header of {length} bytes; not a safetensors file")
            header = json.loads(f.read(length))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    size = os.path.getsize(file)
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}; "
                f"supported: {', '.join(_DTYPES)}"
            )
        begin, end = info["data_offsets"]
        entry = TensorEntry(name, file, dtype, tuple(info["shape"]), base + begin, base + end)
        expected = torch.Size(entry.shape).numel() * dtype.itemsize
        if entry.nbytes != expected or entry.end > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} spans bytes [{begin}, {end}) of a {size - base}-byte "
                f"data section; {dtype} {list(entry.shape)} needs {expected} bytes"
            )
        entries[name] = entry
    return entries


def read_tensor(
    entry: TensorEntry, out: torch.Tensor | None = None, *, f: FileIO | None = None
) -> torch.Tensor:
    """Reads `entry` into `out` (a contiguous CPU tensor of its dtype and shape) or a new tensor.

    `f` is an open unbuffered handle on `entry.file`, to spare an open() per tensor.
    """
    if out is None:
        out = torch.empty(entry.shape, dtype=entry.dtype)
    if entry.nbytes == 0:
        return out
    data: Any = out.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes, writable
    view = memoryview(data)
    handle = f if f is not None else open(entry.file, "rb", buffering=0)
    try:
        handle.seek(entry.start)
        done = 0
        while done < entry.nbytes:
            got = handle.readinto(view[done : min(done + _CHUNK, entry.nbytes)])
            if not got:
                raise CheckpointError(
                    f"{entry.file}: tensor {entry.name!r} ends early ({done} of {entry.nbytes} "
                    "bytes); the file is truncated"
                )
            done += got
    finally:
        if f is None:
            handle.close()
    return out
