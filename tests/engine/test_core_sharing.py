"""On the CPU device, torch gets the cores the CPU expert pool leaves free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe._cpu import pool_info


def test_torch_takes_the_cores_the_pool_leaves(tiny_dir: Callable[..., Any]) -> None:
    path = tiny_dir("qwen3_moe")
    info = pool_info()
    LLM(path, device="cpu", experts="cpu", progress=False)
    assert torch.get_num_threads() == max(1, info["allowed_cpus"] - info["threads"])
    LLM(path, device="cpu", experts="cpu", torch_threads=2, progress=False)
    assert torch.get_num_threads() == 2


def test_torch_threads_untouched_without_cpu_experts(tiny_dir: Callable[..., Any]) -> None:
    torch.set_num_threads(2)
    LLM(tiny_dir("qwen3_moe"), device="cpu", experts="torch", progress=False)
    assert torch.get_num_threads() == 2


def test_torch_threads_must_be_positive(tiny_dir: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="option torch_threads must be positive, got 0"):
        LLM(tiny_dir("qwen3_moe"), torch_threads=0, progress=False)
