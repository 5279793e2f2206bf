"""The package passes `ruff check` and `mypy` (configured in pyproject.toml): CI enforces both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "hetmoe"


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` from the repository root (where pyproject.toml configures the tools)."""
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_is_clean() -> None:
    result = run_tool("ruff", "check", "--no-cache", str(PACKAGE))
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"
    assert "All checks passed" in result.stdout


def test_mypy_is_clean(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A cache in a fresh directory: a cold run (as in CI), never a stale cache of another tree.
    cache = tmp_path_factory.mktemp("mypy-cache")
    result = run_tool("mypy", "--cache-dir", str(cache), str(PACKAGE))
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
    assert result.stdout.startswith("Success: no issues found"), result.stdout
