"""Without a CUDA GPU the Triton kernels run under Triton's interpreter (numpy, on CPU tensors),
so CI checks their values too. The interpreter must be on before Triton is first imported (it
decorates its own library and the kernels then): tests/conftest.py turns it on when the session
starts, before any test module is collected; it is set here again for runs rooted in this folder.
Nothing outside `hetmoe.kernels` uses Triton on a machine without a GPU, so the variable changes
nothing else in the same process."""

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
