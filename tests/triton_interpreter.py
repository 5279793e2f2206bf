"""A faster Triton interpreter for the CPU-only test runs: each call of a `@triton.jit` helper
inside a kernel re-patches `triton.language` (`_patch_lang`: `inspect.getmembers` over the
language modules, ~2 ms a call, a quarter of an int4 pair kernel's time under the interpreter),
although the kernel's own launch patched the same modules and keeps them patched until it
returns. `skip_nested_repatching` makes those nested calls no-ops; the launch's own patch and its
restore are Triton's, so every value the kernels compute is unchanged."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any


class _NothingToRestore:
    """What a skipped nested patch returns (Triton discards it)."""

    def restore(self) -> None:
        pass


def skip_nested_repatching() -> bool:
    """Installs the skip into `triton.runtime.interpreter`; False, with a warning, where that
    module lacks the function it wraps (another Triton: the tests then run unchanged, slower)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        warnings.warn(f"triton {triton.__version__} has no interpreter._patch_lang: the "
                      "interpreted kernel tests run without tests/triton_interpreter.py's "
                      "speed-up", stacklevel=2)
        return False
    if getattr(original, "skips_nested", False):
        return True
    active: list[frozenset[int]] = []  # the language modules the running launch patched
    langs: dict[Callable[..., Any], frozenset[int]] = {}

    def patched_by(fn: Callable[..., Any]) -> frozenset[int]:
        if fn not in langs:  # the modules `_patch_lang` patches for fn
            langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[fn]

    def patch_lang(fn: Callable[..., Any]) -> Any:
        if active and patched_by(fn) <= active[-1]:
            return _NothingToRestore()  # a helper inside a launch: already patched
        scope = original(fn)
        if not active:  # a kernel launch: its restore (Triton's `finally`) ends it
            active.append(patched_by(fn))
            restore = scope.restore

            def restore_and_end() -> None:
                active.pop()
                restore()

            scope.restore = restore_and_end
        return scope

    patch_lang.skips_nested = True  # type: ignore[attr-defined]
    patch_lang.original = original  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    return True
