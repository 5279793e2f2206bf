"""`hetmoe sft` and `generate --lora` end quietly: no nanobind leak report at exit (the CPU
experts' native layers are released before the interpreter unloads `hetmoe._cpu`) and no
transformers deprecation warning from peft's wrapping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sft import PAIRS

CLI = "from hetmoe.cli import app; app()"


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS))
    return path


def _hetmoe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True,
                          timeout=300)


def test_sft_then_generate_with_the_adapter_end_without_leaks_or_warnings(
    tiny_qwen3_moe: Path, data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "adapter"
    sft = _hetmoe("sft", str(tiny_qwen3_moe), str(data), "--out", str(out), "--max-steps", "2",
                  "--seq-len", "64", "--device", "cpu", "--rank", "4")
    assert sft.returncode == 0, sft.stderr
    assert (out / "adapter_model.safetensors").is_file()
    generate = _hetmoe("generate", str(tiny_qwen3_moe), "hi", "--lora", str(out),
                       "--max-new-tokens", "3", "--device", "cpu")
    assert generate.returncode == 0, generate.stderr
    for run in (sft, generate):
        assert "leaked" not in run.stderr, run.stderr
        assert "Warning" not in run.stderr, run.stderr
