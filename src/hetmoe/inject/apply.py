"""Apply validated rules to a model (normally still on `meta`) and report what was replaced."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hetmoe.inject.match import first_match
from hetmoe.inject.registry import OpContext, get_op
from hetmoe.inject.rules import Rule, RuleError


@dataclass(frozen=True)
class Replacement:
    """One module replaced by one rule."""

    name: str
    """Qualified module name, e.g. `model.layers.0.mlp`."""
    original: str
    """Class name of the module that was replaced."""
    op: str
    """Operator it became."""
    device: str
    """Resolved device of the replacement."""
    rule: int
    """Index of the rule that matched."""


@dataclass
class InjectionReport:
    """Everything `apply_rules` replaced, in traversal order."""

    replacements: list[Replacement] = field(default_factory=list)
    """One entry per replaced module."""

    def summary(self) -> str:
        """One line per (op, original class, device) with its count."""
        counts = Counter((r.op, r.original, r.device) for r in self.replacements)
        if not counts:
            return "injection: no module matched any rule"
        lines = [f"injection: {len(self.replacements)} module(s) replaced"]
        lines += [f"  {n:>4} x {orig} -> {op} on {dev}" for (op, orig, dev), n in counts.items()]
        return "\n".join(lines)

    def details(self) -> str:
        """One line per replaced module (what `--verbose` prints)."""
        lines = [self.summary()]
        lines += [
            f"  {r.name}: {r.original} -> {r.op} on {r.device} (rule {r.rule})"
            for r in self.replacements
        ]
        return "\n".join(lines)


def resolve_device(spec: str, main: torch.device, rule: Rule) -> torch.device:
    """Turns a rule's device value into a torch device; error if it names a missing GPU."""
    if spec == "main":
        return main
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise RuleError(
                f"{rule.source}: rule {rule.index}, field replace.device: {spec!r} requested but "
                f"this machine has {count} CUDA device(s); use `main` to follow the engine's device"
            )
        return torch.device("cuda", index)
    return device


def apply_rules(model: nn.Module, rules: Sequence[Rule], ctx: OpContext) -> InjectionReport:
    """Replaces every module matching a rule (first match wins), then visits its children."""
    report = InjectionReport()
    _visit(model, "", rules, ctx, report, set())
    return report


def _visit(
    parent: nn.Module,
    prefix: str,
    rules: Sequence[Rule],
    ctx: OpContext,
    report: InjectionReport,
    replaced: set[int],
) -> None:
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}{child_name}"
        # A replacement may keep the module it replaced as a child: never replace it twice.
        rule = None if id(child) in replaced else first_match(rules, name, child)
        if rule is not None:
            spec = get_op(rule.replace.op)
            assert spec is not None  # validated when parsed
            device = resolve_device(rule.replace.device, ctx.main_device, rule)
            try:
                new = spec.build(child, device, rule.replace.options, ctx)
            except ValueError as exc:
                raise RuleError(
                    f"{rule.source}: rule {rule.index} (op {rule.replace.op}) cannot replace "
                    f"{name} ({type(child).__name__}): {exc}"
                ) from exc
            replaced.add(id(child))
            parent.add_module(child_name, new)
            report.replacements.append(
                Replacement(name, type(child).__name__, rule.replace.op, str(device), rule.index)
            )
            child = new
        _visit(child, f"{name}.", rules, ctx, report, replaced)
