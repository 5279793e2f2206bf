"""The import layers of `src/hetmoe`, as docs/architecture.md draws them: no package imports one
drawn above it, packages import each other in no cycle, and neither do modules. Imports inside
functions count too (hiding an import in a function hides the dependency, not the layer it
climbs), and so do imports under `if TYPE_CHECKING:` (why: the module cycle test's docstring)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "hetmoe"

# Bottom to top. A package is a subpackage of hetmoe or a top-level module; `hetmoe` is the root
# package itself (`__version__`). An import may go down or stay in its layer, never up.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer.split()) for layer in (
    "hetmoe _cpu _cpu_testing env config machine",
    "experts kernels calibration calibration_timing",
    "inject",
    "ops",
    "train",
    "loading",
    "presets",
    "engine",
    "server bench chat_session",
    "cli cli_convert cli_models cli_train cli_exit cli_engine cli_batch cli_batch_sizing",
))

# (importing package, imported package) -> why it may climb. Two at most.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("hetmoe", "engine"): "`hetmoe.LLM` / `hetmoe.GenerationOutput`: the public facade, lazy",
}

# The rooms of `engine/`, bottom to top, by the same rule: a room is a subpackage of engine or a
# module directly in it (`step`: the runner contract both sides speak; `engine`: LLM on top).
ENGINE_ROOMS: tuple[frozenset[str], ...] = tuple(frozenset(room.split()) for room in (
    "step",
    "placement",
    "executor",
    "requests model",
    "engine preplacement",
))

EXTENSIONS = ("_cpu", "_cpu_testing")  # compiled modules: no .py file to find


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    leaf = name.rsplit(".", 1)[-1]
    return path.with_suffix(".py").is_file() or path.is_dir() or leaf in EXTENSIONS


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """(imported hetmoe module, line) for every import in `path`, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("hetmoe"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            if base.split(".")[0] != "hetmoe":
                continue
            for alias in node.names:  # `from hetmoe.x import y`: y may be a module itself
                full = f"{base}.{alias.name}"
                yield (full if is_module(full) else base), node.lineno


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hetmoe"


def layer_of(package: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) if package in layer]
    assert found, f"package {package!r} is in no layer of tests/test_layers.py: draw it there"
    return found[0]


def edges() -> list[tuple[str, str, str]]:
    """(importing module, imported module, file:line) over the whole package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for target, line in imports(path):
            if target != source:
                out.append((source, target, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return out


def test_every_package_is_in_a_layer() -> None:
    packages = {package_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    for package in packages:
        layer_of(package)


def test_no_import_climbs_a_layer() -> None:
    climbs = [
        f"{where}: {source} ({package_of(source)}) imports {target} ({package_of(target)})"
        for source, target, where in edges()
        if layer_of(package_of(target)) > layer_of(package_of(source))
        and (package_of(source), package_of(target)) not in EXCEPTIONS
    ]
    assert not climbs, "imports that climb a layer:\n" + "\n".join(climbs)


def test_exceptions_are_few_and_still_needed() -> None:
    assert len(EXCEPTIONS) <= 2
    found = {(package_of(source), package_of(target)) for source, target, _ in edges()}
    assert set(EXCEPTIONS) <= found, f"stale exceptions: {set(EXCEPTIONS) - found}"


def test_packages_import_each_other_in_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges():
        pair = package_of(source), package_of(target)
        if pair not in EXCEPTIONS and pair[0] != pair[1]:
            graph.setdefault(pair[0], set()).add(pair[1])
    cycle = find_cycle(graph)
    assert cycle is None, f"packages import each other in a cycle: {' -> '.join(cycle or [])}"


# (importing module, imported module) -> why this edge may close a cycle of modules. Two at most.
MODULE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("hetmoe", "hetmoe.engine.engine"): "`hetmoe.LLM`: the public facade, imported lazily by the "
    "root package's `__getattr__`; every module that imports `hetmoe` (`__version__`) and that "
    "`LLM` reaches would close a cycle through it",
}


def test_modules_import_each_other_in_no_cycle() -> None:
    """Modules as nodes, every hetmoe import as an edge, wherever it is written: at module level,
    in a function, or under `if TYPE_CHECKING:`.

    Type-only imports count. They do not run, so they cannot break start-up, but they are
    dependencies a reader follows all the same: in this package each one names a class whose
    members the importing module uses (an owner it calls back, a layer it runs), so two modules
    that name each other's classes must be read together whichever side is type-only. Where a
    lower module needs what a higher one is, it says so as a `Protocol` of the members it uses
    (ops/moe_step.py `StepLayer`, engine/executor/launch_ahead.py `AheadRunner`,
    engine/requests/prompt_fill.py `FillOwner`), and mypy checks the higher module's class
    against it."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for source, target, line in edges():
        if (source, target) not in MODULE_EXCEPTIONS:
            graph.setdefault(source, set()).add(target)
            where.setdefault((source, target), line)
    cycle = find_cycle(graph)
    steps = [f"{where[pair]}: {pair[0]} imports {pair[1]}"
             for pair in pairwise(cycle or [])]
    assert cycle is None, "modules import each other in a cycle:\n" + "\n".join(steps)


def test_module_exceptions_are_few_and_still_needed() -> None:
    assert len(MODULE_EXCEPTIONS) <= 2
    found = {(source, target) for source, target, _ in edges()}
    assert set(MODULE_EXCEPTIONS) <= found, f"stale exceptions: {set(MODULE_EXCEPTIONS) - found}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, else None (depth-first)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def room_of(module: str) -> str:
    return module.split(".")[2]  # hetmoe.engine.<room>[.module]


def room_layer(room: str) -> int:
    found = [i for i, layer in enumerate(ENGINE_ROOMS) if room in layer]
    assert found, f"engine room {room!r} is in no room of tests/test_layers.py: draw it there"
    return found[0]


def engine_edges() -> list[tuple[str, str, str]]:
    """The edges between two modules of `engine/` (its package docstring aside)."""
    return [(s, t, w) for s, t, w in edges()
            if s.startswith("hetmoe.engine.") and t.startswith("hetmoe.engine.")]


def test_every_engine_module_is_in_a_room() -> None:
    for path in (PACKAGE / "engine").rglob("*.py"):
        if (name := module_name(path)) != "hetmoe.engine":
            room_layer(room_of(name))


def test_no_engine_import_climbs_a_room() -> None:
    climbs = [
        f"{where}: {source} ({room_of(source)}) imports {target} ({room_of(target)})"
        for source, target, where in engine_edges()
        if room_layer(room_of(target)) > room_layer(room_of(source))
    ]
    assert not climbs, "engine imports that climb a room:\n" + "\n".join(climbs)


def test_engine_rooms_import_each_other_in_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for source, target, _ in engine_edges():
        if room_of(source) != room_of(target):
            graph.setdefault(room_of(source), set()).add(room_of(target))
    cycle = find_cycle(graph)
    assert cycle is None, f"engine rooms import each other in a cycle: {' -> '.join(cycle or [])}"


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_name_the_module_they_load() -> None:
    edges_ = {(s, t) for s, t, _ in edges()}
    # `from hetmoe import _cpu` (the extension) and `from hetmoe.inject.apply import x` (the module)
    assert ("hetmoe.experts.cpu_moe", "hetmoe._cpu") in edges_
    assert ("hetmoe.engine.engine", "hetmoe.inject.apply") in edges_
