"""Size limits of `src/hetmoe` (the issue's "one concept per file" bar): no Python file over 350
lines, no function over 80 (from its `def` line to its last, docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "hetmoe"
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_is_over_350_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}, f"files over {MAX_FILE_LINES} lines (split them by noun): {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
