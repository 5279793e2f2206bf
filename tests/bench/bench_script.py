"""A benchmark script of `benchmarks/` loaded as a module, for the tests of tests/bench."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(relative: str) -> ModuleType:
    """benchmarks/`relative` (e.g. "serving/bench_serve.py") as a fresh module named as its file,
    its folder first on sys.path while it loads, as `python benchmarks/...` runs it (the
    demo_moe scripts import their folder's demo_moe_eval)."""
    path = BENCHMARKS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
