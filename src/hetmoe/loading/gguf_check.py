"""What is wrong with a file that should be a GGUF file, said in the user's terms: not GGUF at all
(its first bytes), or cut short (the first tensor that runs past the file's end). gguf's own
reader says neither: a random file is read as a checkpoint directory, and a short one fails in
numpy (`cannot reshape array of size ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetmoe.loading.errors import CheckpointError


def check_magic(path: Path) -> None:
    """Refuses a model file that is not a GGUF file (checkpoints are directories)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file "
                              "with b'GGUF'); a model is a GGUF file, a checkpoint directory or "
                              "a preset")


def truncated_tensor(path: Path) -> str | None:
    """The first tensor of GGUF file `path` whose bytes run past the file's end, with the bytes
    it needs and the bytes there; None when every tensor fits (or the header itself is bad)."""
    # gguf is optional: the `demo` extra (pip install 'hetmoe[demo]')
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Bounds(GGUFReader):
        """Parses the header and tensor table as gguf does, then checks sizes, not shapes."""

        found: str | None = None

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                if int(raw_type[0]) not in GGMLQuantizationType._value2member_map_:
                    continue
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                need = int(np.prod(dims)) * type_bytes // block
                start = int(start_offs + offset[0])
                have = max(0, len(self.data) - start)
                if have < need:
                    Bounds.found = (
                        f"{path}: tensor {bytes(name).decode()!r} needs {need} bytes at offset "
                        f"{start}, the file has {have} there (a file of {len(self.data)} "
                        "bytes: cut short?)")
                    return

    try:
        Bounds(path)
    except (ValueError, OSError):
        return None
    return Bounds.found
