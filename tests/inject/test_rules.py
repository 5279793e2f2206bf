"""Rule files: parsing, validation errors (file, rule index, field), and the shipped rules."""

from __future__ import annotations

import pytest

from hetmoe.inject.rules import RULES_DIR, RuleError, load_rules, parse_rules, shipped_rules_path
from hetmoe.presets.tiny import FAMILIES

MOE = "{class: Qwen3MoeSparseMoeBlock}"


def test_parses_name_class_device_and_kwargs() -> None:
    rules = parse_rules(
        "- match: {name: '^model\\.layers\\.\\d+\\.mlp$', class: Qwen3MoeSparseMoeBlock}\n"
        "  replace: {op: hybrid_moe, device: cpu, kwargs: {experts: torch}}\n"
        "- match: {name: 'self_attn$'}\n"
        "  replace: {op: static_kv_attention}\n",
        "my.yaml",
    )
    assert [r.index for r in rules] == [0, 1]
    assert rules[0].match.name is not None and rules[0].match.name.pattern.endswith("mlp$")
    assert rules[0].match.cls == "Qwen3MoeSparseMoeBlock"
    assert (rules[0].replace.op, rules[0].replace.device) == ("hybrid_moe", "cpu")
    assert rules[0].replace.options.experts == "torch"
    assert rules[1].replace.device == "main"  # the default: the engine's device
    assert rules[1].match.cls is None and rules[1].source == "my.yaml"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"- match: {MOE}\n  replace: {{op: fancy_moe}}\n",
         "rule 0, field replace.op: unknown op 'fancy_moe' (known: hybrid_moe, mla_attention, "
         "static_kv_attention"),
        ("- match: {name: 'layers.(0'}\n  replace: {op: hybrid_moe}\n",
         "rule 0, field match.name: bad regex 'layers.(0': missing ), unterminated subpattern"),
        (f"- match: {MOE}\n  replace: {{op: hybrid_moe, kwargs: {{experts: gpu9}}}}\n",
         "rule 0, field replace.kwargs: experts='gpu9' is not a registered expert backend"),
        (f"- match: {MOE}\n  replace: {{op: hybrid_moe, kwargs: {{warp_factor: 2}}}}\n",
         "rule 0, field replace.kwargs: unknown kwarg 'warp_factor' for op 'hybrid_moe' "
         "(known: experts, weight_format"),
        (f"- match: {MOE}\n  replace: {{op: hybrid_moe, kwargs: {{experts: 3}}}}\n",
         "rule 0, field replace.kwargs: kwarg 'experts' of op 'hybrid_moe' must be str, got 3"),
        (f"- match: {MOE}\n  replace: {{op: hybrid_moe, device: gpu}}\n",
         "rule 0, field replace.device: expected main, cpu, cuda or cuda:N, found 'gpu'"),
        ("- match: {}\n  replace: {op: hybrid_moe}\n",
         "rule 0, field match: needs `name`, `class` or both"),
        ("- match: {clas: X}\n  replace: {op: hybrid_moe}\n",
         "rule 0, field match: unknown key(s) clas (allowed: class, name)"),
        (f"- match: {MOE}\n  replace: {{op: hybrid_moe}}\n  when: always\n",
         "rule 0, field rule: unknown key(s) when (allowed: match, replace)"),
        (f"- match: {MOE}\n", "rule 0, field replace: missing"),
        ("- match: {class: 'not a class'}\n  replace: {op: hybrid_moe}\n",
         "rule 0, field match.class: expected ClassName or dotted.path, found 'not a class'"),
        ("match: {class: X}\n", "expected a YAML list of rules, found dict"),
    ],
)
def test_errors_name_file_rule_and_field(text: str, expected: str) -> None:
    with pytest.raises(RuleError) as err:
        parse_rules(text, "user.yaml")
    assert str(err.value).startswith("user.yaml: ")
    assert expected in str(err.value)


def test_error_names_the_index_of_the_bad_rule() -> None:
    good = f"- match: {MOE}\n  replace: {{op: hybrid_moe}}\n"
    bad = "- match: {name: '['}\n  replace: {op: hybrid_moe}\n"
    with pytest.raises(RuleError, match=r"rule 2, field match\.name: bad regex '\['"):
        parse_rules(good + good + bad)


def test_unreadable_and_invalid_yaml_files(tmp_path) -> None:
    with pytest.raises(RuleError, match="cannot read rule file .*nope.yaml"):
        load_rules(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("- match: {name: [\n")
    with pytest.raises(RuleError, match="broken.yaml: not valid YAML"):
        load_rules(broken)


def test_every_family_ships_valid_rules() -> None:
    for family in FAMILIES:
        rules = load_rules(shipped_rules_path(family))
        ops = sorted(r.replace.op for r in rules)
        attention = "mla_attention" if family.startswith("deepseek") else "static_kv_attention"
        assert ops == sorted(["hybrid_moe", attention]), family
        assert all(r.replace.device == "main" for r in rules)
    assert sorted(p.stem for p in RULES_DIR.glob("*.yaml")) == sorted(FAMILIES)


def test_unsupported_family_has_no_rules() -> None:
    with pytest.raises(RuleError, match="no shipped rules for model_type 'llama' .*mixtral"):
        shipped_rules_path("llama")
