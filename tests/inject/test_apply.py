"""Matching by name and class, application through the registry, traversal and the report."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hetmoe.inject.apply import apply_rules
from hetmoe.inject.match import class_matches, first_match
from hetmoe.inject.registry import OpContext, get_op, register_op
from hetmoe.inject.rules import RuleError, parse_rules
from hetmoe.presets.tiny import tiny_config


@dataclass(frozen=True)
class TagOptions:
    """Options of the test-only `test_tag` op."""

    label: str = "tag"
    """Written on the wrapper."""


class Tagged(nn.Module):
    """Wraps a module so tests can see it was replaced (and still reach its children)."""

    def __init__(self, inner: nn.Module, device: torch.device, label: str) -> None:
        super().__init__()
        self.inner = inner
        self.device = device
        self.label = label


if get_op("test_tag") is None:
    register_op("test_tag", TagOptions)(
        lambda module, device, options, ctx: Tagged(module, device, options.label)
    )


def skeleton(family: str = "qwen3_moe") -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family))


def context(model: nn.Module) -> OpContext:
    return OpContext(torch.device("cpu"), torch.float32, model.config)


def test_matchers_by_name_class_both_and_none() -> None:
    model = skeleton()
    mlp, attn = model.model.layers[1].mlp, model.model.layers[1].self_attn
    rules = parse_rules(
        "- match: {name: 'layers\\.0\\.mlp$'}\n  replace: {op: test_tag, kwargs: {label: name}}\n"
        "- match: {class: Qwen3MoeAttention}\n  replace: {op: test_tag, kwargs: {label: class}}\n"
        "- match: {name: 'layers\\.1\\.', class: transformers.models.qwen3_moe.modeling_qwen3_moe"
        ".Qwen3MoeSparseMoeBlock}\n  replace: {op: test_tag, kwargs: {label: both}}\n"
    )
    by_name = first_match(rules, "model.layers.0.mlp", model.model.layers[0].mlp)
    assert by_name is not None and by_name.index == 0
    by_class = first_match(rules, "model.layers.1.self_attn", attn)
    assert by_class is not None and by_class.index == 1
    both = first_match(rules, "model.layers.1.mlp", mlp)
    assert both is not None and both.index == 2
    # Name right, class wrong / class right, name wrong / nothing at all: no match.
    assert first_match(rules[2:], "model.layers.1.mlp.gate", mlp.gate) is None
    assert first_match(rules[2:], "model.layers.0.mlp", model.model.layers[0].mlp) is None
    assert first_match(rules, "model.norm", model.model.norm) is None


def test_class_matches_bare_dotted_and_base_class_names() -> None:
    attn = skeleton().model.layers[0].self_attn
    assert class_matches("Qwen3MoeAttention", attn)
    assert class_matches("transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeAttention", attn)
    assert class_matches("torch.nn.modules.module.Module", attn)
    assert not class_matches("qwen3_moe.Qwen3MoeAttention", attn)
    assert not class_matches("MixtralAttention", attn)


def test_apply_replaces_reports_and_visits_the_replacements_children() -> None:
    model = skeleton()
    rules = parse_rules(
        "- match: {class: Qwen3MoeSparseMoeBlock}\n"
        "  replace: {op: test_tag, kwargs: {label: moe}}\n"
        "- match: {name: 'mlp\\.inner\\.gate$'}\n  replace: {op: test_tag, device: cpu}\n"
    )
    report = apply_rules(model, rules, context(model))
    names = [(r.name, r.original, r.rule) for r in report.replacements]
    assert names == [
        ("model.layers.0.mlp", "Qwen3MoeSparseMoeBlock", 0),
        ("model.layers.0.mlp.inner.gate", "Qwen3MoeTopKRouter", 1),
        ("model.layers.1.mlp", "Qwen3MoeSparseMoeBlock", 0),
        ("model.layers.1.mlp.inner.gate", "Qwen3MoeTopKRouter", 1),
    ]
    outer = model.model.layers[0].mlp
    assert isinstance(outer, Tagged) and outer.label == "moe"
    assert isinstance(outer.inner.gate, Tagged) and outer.inner.gate.label == "tag"
    assert report.summary().splitlines() == [
        "injection: 4 module(s) replaced",
        "     2 x Qwen3MoeSparseMoeBlock -> test_tag on cpu",
        "     2 x Qwen3MoeTopKRouter -> test_tag on cpu",
    ]
    assert "  model.layers.1.mlp.inner.gate: Qwen3MoeTopKRouter -> test_tag on cpu (rule 1)" in (
        report.details().splitlines()
    )


def test_no_match_leaves_the_model_alone() -> None:
    model = skeleton()
    before = [type(m).__name__ for m in model.modules()]
    report = apply_rules(model, parse_rules("- match: {class: MixtralAttention}\n"
                                            "  replace: {op: test_tag}\n"), context(model))
    assert report.replacements == []
    assert report.summary() == "injection: no module matched any rule"
    assert [type(m).__name__ for m in model.modules()] == before


def test_missing_gpu_is_an_error_naming_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = skeleton()
    rules = parse_rules("- match: {class: Qwen3MoeAttention}\n"
                        "  replace: {op: test_tag, device: 'cuda:1'}\n", "gpu.yaml")
    with pytest.raises(RuleError, match=r"gpu.yaml: rule 0, field replace.device: 'cuda:1' "
                                        r"requested but this machine has 0 CUDA device\(s\)"):
        apply_rules(model, rules, context(model))


def test_op_refusing_a_module_names_rule_and_module() -> None:
    model = skeleton()
    rules = parse_rules("- match: {name: 'layers\\.0\\.self_attn$'}\n"
                        "  replace: {op: hybrid_moe}\n", "wrong.yaml")
    with pytest.raises(RuleError, match=r"wrong.yaml: rule 0 \(op hybrid_moe\) cannot replace "
                                        r"model.layers.0.self_attn \(Qwen3MoeAttention\): "
                                        r"hybrid_moe replaces sparse-MoE blocks"):
        apply_rules(model, rules, context(model))
