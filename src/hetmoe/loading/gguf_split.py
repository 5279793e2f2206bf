"""GGUF files split in parts (`NAME-00001-of-00003.gguf`, as llama.cpp's gguf-split and
gguf-py's writer make them, and as large Hub quants ship): read as one file.

Every part is a GGUF file of its own; the first holds the model's metadata, each holds some of
the tensors. Opening part 1 opens them all; another part, or a split with a part missing, is
refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetmoe.loading.errors import CheckpointError

_PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """The files of the GGUF at `path`: all parts in order for part 1 of a split, else
    `[path]`."""
    match = _PART.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["no"]) != 1:
        raise CheckpointError(f"{path}: part {int(match['no'])} of a {count}-part GGUF; open "
                              f"its first part, {match['stem']}-00001-of-{match['count']}.gguf")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf")
             for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: a {count}-part GGUF without {', '.join(missing)}")
    return parts


@dataclass(frozen=True)
class SplitReader:
    """The `gguf.GGUFReader` faces the loader uses (`fields`, `tensors`) over all parts."""

    readers: tuple[Any, ...]
    """One reader per part, in order."""

    @property
    def fields(self) -> Any:
        """The first part's metadata (the model's; later parts carry only `split.*`)."""
        return self.readers[0].fields

    @property
    def tensors(self) -> list[Any]:
        """Every part's tensors, in part order."""
        return [t for reader in self.readers for t in reader.tensors]


def open_reader(path: Path) -> Any:
    """A `gguf.GGUFReader` of `path`, or a `SplitReader` over its parts."""
    # gguf is optional: the `demo` extra (pip install 'hetmoe[demo]')
    from gguf import GGUFReader

    parts = split_parts(path)
    if len(parts) == 1:
        return GGUFReader(path)
    return SplitReader(tuple(GGUFReader(p) for p in parts))
