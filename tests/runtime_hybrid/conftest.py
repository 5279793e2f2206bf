"""Hybrid-runtime fixtures: fp32 baby engines, routed experts in the C++ CPU backend or torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hetmoe import LLM
from hetmoe.experts.backend import backends


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


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_torch_thread: None) -> None:
    """Every test module of this folder runs with one torch thread."""
