"""Which rule, if any, applies to a module: by qualified name, by class, or both."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hetmoe.inject.rules import Match, Rule


def class_matches(spec: str, module: nn.Module) -> bool:
    """True when `spec` names the module's class or a base: bare name or dotted module path."""
    for klass in type(module).__mro__:
        if spec == klass.__name__ or spec == f"{klass.__module__}.{klass.__qualname__}":
            return True
    return False


def matches(match: Match, name: str, module: nn.Module) -> bool:
    """True when every condition the match sets holds for the module called `name`."""
    if match.name is not None and match.name.search(name) is None:
        return False
    return match.cls is None or class_matches(match.cls, module)


def first_match(rules: Sequence[Rule], name: str, module: nn.Module) -> Rule | None:
    """The first rule (file order) matching the module, or None."""
    for rule in rules:
        if matches(rule.match, name, module):
            return rule
    return None
