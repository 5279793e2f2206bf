"""Kernels compiled for a Hopper GPU (sm_90) on any machine: Triton's compiler and its bundled
ptxas need no GPU. The build runs in its own process without TRITON_INTERPRET, which this
folder's conftest sets without a GPU: the interpreter accepts code the compiler refuses and takes
`dequant.INTERPRETED`'s branches, so the compiled branches are checked only there.

A build script imports `compile_for_hopper` from here (`assert_compiles_for_hopper` puts this
folder on its path) and prints "compiled" when every kernel built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest


def compile_for_hopper(fn: Any, types: Mapping[str, str], *, aligned: bool = False,
                       options: Mapping[str, int] | None = None, **consts: object) -> Any:
    """The @triton.jit kernel `fn` compiled for sm_90 -> Triton's CompiledKernel (PTX in
    `.asm["ptx"]`). `types`: the Triton type of each parameter not in `consts` ("*bf16", "i32",
    "fp32"; extra names ignored); `aligned`: every pointer and int argument 16-divisible, as
    launches at real model shapes specialize; `options`: triton.compile's (num_warps,
    num_stages); `consts`: the constexprs' values. A kernel with a `PDL` constexpr
    (kernels/pdl.py) not given one compiles with PDL on, as a Hopper launches it, and its PTX is
    checked to wait for the kernel before it and to let the next one start."""
    # imported here, not above: the pytest process imports this module and may lack Triton
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hetmoe.kernels import dequant

    assert not dequant.INTERPRETED, "TRITON_INTERPRET is set: the interpreter's branches"
    pdl = "PDL" in {p.name for p in fn.params} and "PDL" not in consts
    if pdl:
        consts = {**consts, "PDL": True}
    signature = {p.name: "constexpr" if p.name in consts else types[p.name] for p in fn.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if signature[p.name] != "constexpr"} if aligned else None
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    if pdl:
        ptx = kernel.asm["ptx"]
        assert ptx.count("griddepcontrol.wait") >= 1, f"{fn.__name__}: no griddepcontrol.wait"
        assert "griddepcontrol.launch_dependents" in ptx or fn.__name__ in WAIT_ONLY, (
            f"{fn.__name__}: no griddepcontrol.launch_dependents")
    return kernel


WAIT_ONLY = {"combine_kernel", "reduce_kernel", "logits_kernel", "topk_kernel"}
"""PDL kernels that only wait: the next kernel starts at their exit (short kernels)."""


def assert_compiles_for_hopper(script: str) -> None:
    """Runs `script` (Python that builds kernels and prints "compiled" when all built) in a fresh
    interpreter-free process; fails with its stderr's end."""
    pytest.importorskip("triton", reason="the kernels need Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = str(Path(__file__).parent)  # the script's `from hopper_compile import ...`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, env.get("PYTHONPATH"))))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "compiled", run.stderr[-3000:]
