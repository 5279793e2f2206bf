"""Shared fixtures: tiny random checkpoints of every family, built once per test session."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe.experts.backend import backends
from hetmoe.presets.tiny import FAMILIES, build_tiny_model

if not torch.cuda.is_available():
    # Without a CUDA GPU the Triton kernels run under Triton's interpreter (tests/kernels). Triton
    # decorates its own library (tl.zeros ...) and our kernels when first imported, so the
    # interpreter must be on before any test module imports it: a benchmark script loaded at
    # collection (tests/bench) imports the kernels long before tests/kernels is collected.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from triton_interpreter import skip_nested_repatching

    skip_nested_repatching()  # the interpreted kernels' values unchanged, ~25 % faster

TinyDir = Callable[..., Path]


def pytest_report_header() -> str:
    """The versions a run was checked against (CI runs the family tests on the oldest and the
    newest transformers the project allows)."""
    import transformers

    return f"hetmoe versions: torch {torch.__version__}, transformers {transformers.__version__}"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> TinyDir:
    """`tiny_dir(family, **options)` → a checkpoint dir built by `build_tiny_model`, cached per
    (family, options) for the session; treat it as read-only."""
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def get(family: str, **options: Any) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            built[key] = build_tiny_model(family, path, **options)
        return built[key]

    return get


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a module: baby tensors on a shared 2-core box gain nothing from
    intra-op threads, and threads that spin-wait for a busy core slow each step a hundredfold."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_family(request: pytest.FixtureRequest, tiny_dir: TinyDir) -> tuple[str, Path]:
    """(family, checkpoint dir) for each supported family in turn (fp32, default options)."""
    return request.param, tiny_dir(request.param)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_dir: TinyDir) -> Path:
    return tiny_dir("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tiny_dir: TinyDir) -> Path:
    return tiny_dir("qwen2_moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v2(tiny_dir: TinyDir) -> Path:
    return tiny_dir("deepseek_v2")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tiny_dir: TinyDir) -> Path:
    return tiny_dir("deepseek_v3")


@pytest.fixture(scope="session")
def tiny_mixtral(tiny_dir: TinyDir) -> Path:
    return tiny_dir("mixtral")


@pytest.fixture(scope="session")
def engine(tiny_dir: Callable[..., object]) -> Callable[[str, str], LLM]:
    """`engine(family, experts)`: a cached fp32 CPU `LLM` with experts `cpu` or `torch`."""
    built: dict[tuple[str, str], LLM] = {}

    def get(family: str, experts: str) -> LLM:
        if experts == "cpu" and "cpu" not in backends():
            pytest.fail("the `cpu` expert backend is not registered (hetmoe._cpu not built?)")
        key = (family, experts)
        if key not in built:
            built[key] = LLM(tiny_dir(family), device="cpu", dtype="float32", experts=experts,
                             progress=False, max_seq_len=64)
        return built[key]

    return get


@pytest.fixture(scope="session")
def persona_adapter(tiny_dir: TinyDir, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, Path]:
    """(tiny qwen3_moe checkpoint, the persona adapter tuned on it: tests/persona.py), tuned
    once per session for every test that serves or checks it."""
    from persona import train_persona

    base = tiny_dir("qwen3_moe")
    work = tmp_path_factory.mktemp("persona")
    result = train_persona(base, work)
    assert result.history[-1].loss < 0.1 < result.history[0].loss
    return base, work / "adapter"
