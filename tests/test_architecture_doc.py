"""docs/architecture.md stays true to the tree: lines of at most 120 characters, every file of
`src/hetmoe` named (by file name) in its package's section, and the layer drawing equal to the
layers tests/test_layers.py checks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layers import ENGINE_ROOMS, LAYERS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "hetmoe"
MAX_LINE = 120


def sections() -> dict[str, str]:
    """Folder (`src/hetmoe/ops/`) -> the text of every `### `folder`` section that heads it."""
    found: dict[str, str] = {}
    for part in re.split(r"^### ", DOC.read_text(), flags=re.M)[1:]:
        if heading := re.match(r"`(src/hetmoe/[\w/]*)`", part):
            found[heading.group(1)] = found.get(heading.group(1), "") + part
    return found


def named_files() -> list[Path]:
    """Every file of the package the doc must name: sources, rules, the chat page; an
    `__init__.py` only when it holds more than its docstring."""
    files = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if path.name == "__init__.py" and len(ast.parse(path.read_text()).body) <= 1:
            continue
        files.append(path)
    return files


def test_no_line_is_over_120_characters() -> None:
    long = [f"line {n}: {len(line)} characters"
            for n, line in enumerate(DOC.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"docs/architecture.md has lines over {MAX_LINE} characters: {long}"


def test_every_package_file_is_named_in_its_section() -> None:
    found = sections()
    missing = []
    for path in named_files():
        rel = path.relative_to(PACKAGE.parent.parent)
        folder = f"{rel.parent}/"
        if "static" in rel.parts:  # the chat page: named in the server's section
            folder = f"{rel.parent.parent}/"
        if f"`{path.name}`" not in found.get(folder, ""):
            missing.append(f"{rel} (no `{path.name}` under a '### `{folder}`' heading)")
    assert not missing, "files docs/architecture.md does not name:\n" + "\n".join(missing)


def drawn_rows() -> dict[str, frozenset[str]]:
    """The layer drawing's rows: index (`3`, `7.2`) -> the names left of its `|`."""
    text = DOC.read_text().split("## Import layers", 1)[1].split("```")[1]
    rows = {}
    for line in text.splitlines():
        if match := re.match(r"^(\d+(?:\.\d+)?)\s+([^|]+)\|", line):
            rows[match.group(1)] = frozenset(match.group(2).split())
    return rows


def test_the_layer_drawing_is_the_tested_layers() -> None:
    rows = drawn_rows()
    drawn = {index: names for index, names in rows.items() if "." not in index}
    assert drawn == {str(i): layer for i, layer in enumerate(LAYERS)}
    rooms = {index: names for index, names in rows.items() if "." in index}
    engine = str(next(i for i, layer in enumerate(LAYERS) if "engine" in layer))
    assert rooms == {f"{engine}.{i}": room for i, room in enumerate(ENGINE_ROOMS)}

