"""A benchmark script of `benchmarks/` loaded as a module, for the tests of tests/bench."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(relative: str) -> ModuleType:
    """benchmarks/`relative` (e.g. "serving/bench_serve.py") as a fresh module named as its file."""
    path = BENCHMARKS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
