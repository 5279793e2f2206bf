"""Kernels compiled for a Hopper GPU (sm_90) on any machine: Triton's compiler and its bundled
ptxas need no GPU. The build runs in its own process without TRITON_INTERPRET, which this
folder's conftest sets without a GPU: the interpreter accepts code the compiler refuses and takes
`dequant.INTERPRETED`'s branches, so the compiled branches are checked only there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def assert_compiles_for_hopper(script: str) -> None:
    """Runs `script` (Python that builds kernels and prints "compiled" when all built) in a fresh
    interpreter-free process; fails with its stderr's end."""
    pytest.importorskip("triton", reason="the kernels need Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "compiled", run.stderr[-3000:]
