"""Engine fixtures: one fp32 `LLM` per baby family for the session, one torch thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

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
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors on a shared 2-core box: intra-op parallel regions only cost time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
