"""Rule files: parse and validate YAML injection rules before any model is touched.

A rule file is a YAML list; each rule is

    - match: {name: <regex on the qualified module name>, class: <ClassName or dotted.path>}
      replace: {op: <registered operator>, device: <main|cpu|cuda|cuda:N>, kwargs: {...}}

`match` needs `name`, `class` or both (both must hold). `name` is searched (use ^ and $ to anchor).
`device` defaults to `main`, the engine's device (cuda when available, else cpu). Every error
names the file, the rule's index (0-based) and the field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hetmoe.inject.registry import get_op, make_options, op_names

RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
_DEVICE = re.compile(r"^(main|cpu|cuda(:\d+)?)$")
_CLASS = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class RuleError(ValueError):
    """A rule file that cannot be used; the message names file, rule index and field."""


@dataclass(frozen=True)
class Match:
    """Which modules a rule applies to."""

    name: re.Pattern[str] | None
    """Searched in the module's qualified name (e.g. `model.layers.3.mlp`)."""
    cls: str | None
    """Class name (`Qwen3MoeSparseMoeBlock`) or dotted path of it or of a base class."""


@dataclass(frozen=True)
class Replace:
    """What a matched module becomes."""

    op: str
    """Registered operator name."""
    device: str
    """`main`, `cpu`, `cuda` or `cuda:N`; resolved when the rule is applied."""
    options: Any
    """The operator's kwargs dataclass, already validated."""


@dataclass(frozen=True)
class Rule:
    """One validated rule."""

    index: int
    """Position in its file, 0-based (as error messages and reports show it)."""
    source: str
    """File the rule came from (or `<string>`)."""
    match: Match
    """Which modules it applies to."""
    replace: Replace
    """What they become."""


def parse_rules(text: str, source: str = "<string>") -> list[Rule]:
    """Parses and validates a YAML rule list; raises RuleError naming rule index and field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RuleError(f"{source}: not valid YAML: {exc}") from exc
    if data is None:
        data = []
    if not isinstance(data, list):
        raise RuleError(f"{source}: expected a YAML list of rules, found {type(data).__name__}")
    return [_parse_rule(entry, i, source) for i, entry in enumerate(data)]


def load_rules(path: str | os.PathLike[str]) -> list[Rule]:
    """Reads and validates a rule file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RuleError(f"cannot read rule file {path}: {exc.strerror}") from exc
    return parse_rules(text, str(path))


def shipped_rules_path(model_type: str) -> Path:
    """The rule file shipped for a family (`rules/<model_type>.yaml`); error if there is none."""
    path = RULES_DIR / f"{model_type}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in RULES_DIR.glob("*.yaml")))
        raise RuleError(
            f"no shipped rules for model_type {model_type!r} (families with rules: {known}); "
            "pass your own rule file"
        )
    return path


def _fail(source: str, index: int, field: str, problem: str) -> RuleError:
    return RuleError(f"{source}: rule {index}, field {field}: {problem}")


def _mapping(value: Any, source: str, index: int, field: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(source, index, field, f"expected a mapping, found {value!r}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise _fail(
            source, index, field, f"unknown key(s) {', '.join(map(str, unknown))} "
            f"(allowed: {', '.join(sorted(keys))})"
        )
    return value


def _parse_rule(entry: Any, index: int, source: str) -> Rule:
    entry = _mapping(entry, source, index, "rule", {"match", "replace"})
    for key in ("match", "replace"):
        if key not in entry:
            raise _fail(source, index, key, "missing")
    return Rule(index, source, _parse_match(entry["match"], index, source),
                _parse_replace(entry["replace"], index, source))


def _parse_match(value: Any, index: int, source: str) -> Match:
    value = _mapping(value, source, index, "match", {"name", "class"})
    if not value.get("name") and not value.get("class"):
        raise _fail(source, index, "match", "needs `name`, `class` or both")
    pattern = None
    if "name" in value:
        if not isinstance(value["name"], str):
            raise _fail(source, index, "match.name", f"expected a regex, found {value['name']!r}")
        try:
            pattern = re.compile(value["name"])
        except re.error as exc:
            raise _fail(source, index, "match.name", f"bad regex {value['name']!r}: {exc}") from exc
    cls = value.get("class")
    if cls is not None and not (isinstance(cls, str) and _CLASS.match(cls)):
        raise _fail(source, index, "match.class",
                    f"expected ClassName or dotted.path, found {cls!r}")
    return Match(pattern, cls)


def _parse_replace(value: Any, index: int, source: str) -> Replace:
    value = _mapping(value, source, index, "replace", {"op", "device", "kwargs"})
    op = value.get("op")
    spec = get_op(op) if isinstance(op, str) else None
    if spec is None:
        raise _fail(source, index, "replace.op",
                    f"unknown op {op!r} (known: {', '.join(op_names())})")
    device = value.get("device", "main")
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise _fail(source, index, "replace.device",
                    f"expected main, cpu, cuda or cuda:N, found {device!r}")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _fail(source, index, "replace.kwargs", f"expected a mapping, found {kwargs!r}")
    try:
        options = make_options(spec, kwargs)
    except (TypeError, ValueError) as exc:
        raise _fail(source, index, "replace.kwargs", str(exc)) from exc
    return Replace(op, device, options)
