"""Engine fixtures: fp32 baby engines (routed experts in torch or the C++ CPU backend), one torch
thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hetmoe import LLM


@pytest.fixture(scope="session")
def llm_of(tiny_dir: Callable[..., Any]) -> Callable[[str], LLM]:
    """`llm_of(family)`: a cached fp32 engine (torch experts) on the family's baby model."""
    built: dict[str, LLM] = {}

    def get(family: str) -> LLM:
        if family not in built:
            built[family] = LLM(
                tiny_dir(family), device="cpu", dtype="float32", experts="torch", progress=False
            )
        return built[family]

    return get


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_torch_thread: None) -> None:
    """Every test module of this folder runs with one torch thread."""
