"""Without a CUDA GPU the Triton kernels run under Triton's interpreter (numpy, on CPU tensors),
so CI checks their values too. It must be on before a kernel module is first imported (the
kernels are decorated then); the kernel modules are imported lazily (first call), so setting it
while this directory is collected is early enough. Nothing outside `hetmoe.kernels` uses Triton
on a machine without a GPU, so the variable changes nothing else in the same process."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpreted() -> None:
    """Tests that run the kernels need Triton (the GPU's, or its interpreter on the CPU)."""
    pytest.importorskip("triton", reason="the kernels need Triton (pip install triton)")
