"""Shared fixtures: tiny random checkpoints of every family, built once per test session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetmoe.presets.tiny import FAMILIES, build_tiny_model

TinyDir = Callable[..., Path]


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
