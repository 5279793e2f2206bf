"""GGUF files split in parts read as one file; a part opened alone or a missing part is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_hub import write_gguf

from hetmoe.loading import CheckpointError
from hetmoe.loading.gguf import open_gguf


def test_parts_read_as_the_whole_file_and_missing_parts_are_named(tiny_dir, tmp_path: Path
                                                                   ) -> None:
    source = tiny_dir("qwen3_moe")
    whole = open_gguf(write_gguf(source, tmp_path / "whole.gguf", "F32")[0])
    parts = write_gguf(source, tmp_path / "m-F32.gguf", "F32", 14)
    assert [p.name for p in parts] == ["m-F32-00001-of-00002.gguf", "m-F32-00002-of-00002.gguf"]
    split = open_gguf(parts[0])
    assert [t.name for t in split.reader.tensors] == [t.name for t in whole.reader.tensors]
    assert split.metadata["qwen3moe.expert_count"] == whole.metadata["qwen3moe.expert_count"]
    with pytest.raises(CheckpointError, match=r"m-F32-00002-of-00002.gguf: part 2 of a 2-part "
                                              r"GGUF; open its first part, "
                                              r"m-F32-00001-of-00002.gguf"):
        open_gguf(parts[1])
    parts[1].unlink()
    with pytest.raises(CheckpointError, match=r"m-F32-00001-of-00002.gguf: a 2-part GGUF "
                                              r"without m-F32-00002-of-00002.gguf"):
        open_gguf(parts[0])
