"""tests/triton_interpreter.py: under the interpreter a kernel's launch patches the language once,
its helpers' calls patch nothing more, the values are the kernel's, and the language is back as it
was after the launch (also after a launch that raised)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton", reason="the interpreter hook needs Triton")

import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton_interpreter import skip_nested_repatching  # noqa: E402


# Interpreted whatever TRITON_INTERPRET says (on a GPU host too), as `triton.jit` makes them
# under it: the kernel's helper is itself an interpreted function.
def _twice_py(x):
    return x * 2


_twice = interpreter.InterpretedFunction(_twice_py)


def _helpers_kernel_py(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _twice(_twice(_twice(x))) + 1)


def _failing_kernel_py(x_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(x_ptr + tl.arange(0, BLOCK), _twice(x, x))  # one argument too many


_helpers_kernel = interpreter.InterpretedFunction(_helpers_kernel_py)
_failing_kernel = interpreter.InterpretedFunction(_failing_kernel_py)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[Callable[..., Any]]:
    """Triton's own `_patch_lang` (unhooked) under a recorder of the functions it patches for."""
    real = getattr(interpreter._patch_lang, "original", interpreter._patch_lang)
    calls: list[Callable[..., Any]] = []

    def record(fn: Callable[..., Any]) -> Any:
        calls.append(fn)
        return real(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", record)
    return calls


@pytest.mark.parametrize("hooked", [False, True])
def test_helpers_inside_a_launch_patch_nothing_more(monkeypatch: pytest.MonkeyPatch,
                                                    hooked: bool) -> None:
    calls = _counting(monkeypatch)
    if hooked:
        assert skip_nested_repatching()
    zeros = tl.zeros
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _helpers_kernel[(2,)](x, out, BLOCK=8)
    assert torch.equal(out, x * 8 + 1)
    names = [fn.__name__ for fn in calls]
    # two programs, each calling the helper 3 times: Triton alone patches again at each call
    assert names == (["_helpers_kernel_py"] if hooked
                     else ["_helpers_kernel_py"] + ["_twice_py"] * 6)
    assert tl.zeros is zeros  # the launch's restore put the language back


def test_a_launch_that_raises_still_ends_its_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    assert skip_nested_repatching()
    zeros = tl.zeros
    with pytest.raises(interpreter.InterpreterError, match="_twice_py.. takes 1 positional"):
        _failing_kernel[(1,)](torch.zeros(8), BLOCK=8)
    assert tl.zeros is zeros
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _helpers_kernel[(1,)](x, out, BLOCK=8)
    assert torch.equal(out, x * 8 + 1)
    assert [fn.__name__ for fn in calls][-1:] == ["_helpers_kernel_py"]
