"""benchmarks/demo_moe/demo_moe_eval.py, what the demo-moe scripts measure alike: perplexity
against a float64 reference, the question set's scoring, the stamp line and the marked tables."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from bench_script import load_script

EVAL = load_script("demo_moe/demo_moe_eval.py")


def test_perplexity_is_exp_of_the_mean_next_token_nll_over_all_windows() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    windows = [[1, 4, 2, 9, 3], [7, 7, 0, 5, 10]]
    table = {tuple(w): torch.randn(len(w), vocab, generator=gen) for w in windows}  # [T, V]
    seen: list[int] = []
    got = EVAL.perplexity(lambda ids: table[tuple(ids)], windows,
                          lambda w, logp: seen.append(w))
    nll, count = 0.0, 0
    for w in windows:  # float64 reference, position by position
        logits = table[tuple(w)].double()
        for t in range(len(w) - 1):
            row = logits[t]
            nll += float(torch.logsumexp(row, 0) - row[w[t + 1]])
            count += 1
    assert got == pytest.approx(math.exp(nll / count), rel=1e-6)
    assert seen == [0, 1]


def test_perplexity_refuses_windows_without_a_next_token() -> None:
    with pytest.raises(ValueError, match=r"window 1 has 1 token\(s\); perplexity needs at least 2"):
        EVAL.perplexity(lambda ids: torch.zeros(len(ids), 3), [[1, 2], [1]])
    with pytest.raises(ValueError, match="at least one window; got none"):
        EVAL.perplexity(lambda ids: torch.zeros(len(ids), 3), [])


def test_answers_are_right_when_they_hold_an_accepted_answer_case_folded() -> None:
    paris = next(i for i, (q, _) in enumerate(EVAL.QUESTIONS) if "France" in q)
    spider = next(i for i, (q, _) in enumerate(EVAL.QUESTIONS) if "spider" in q)
    replies = ["The capital is PARIS.", "Spiders have six legs."]
    assert EVAL.answered_right([paris, spider], replies) == [paris]
    assert EVAL.exact_match([paris, spider], replies) == 0.5
    assert EVAL.exact_match([], []) == 0.0
    with pytest.raises(ValueError, match="2 questions but 1 replies"):
        EVAL.answered_right([paris, spider], replies[:1])


def test_stamp_names_the_script_from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EVAL, "source_commit", lambda root: "abc1234")
    facts = EVAL.stamp(str(EVAL.ROOT / "benchmarks/demo_moe/quality.py"), ["--windows", "2"])
    assert facts["command"] == "python benchmarks/demo_moe/quality.py --windows 2"
    assert facts["git"] == "abc1234"
    assert facts["machine"].endswith(f", {torch.get_num_threads()} torch threads")
    line = EVAL.stamp_line(facts, "16 questions")
    assert line == (f"`python benchmarks/demo_moe/quality.py --windows 2` ({facts['date']}, "
                    f"{facts['machine']}, git abc1234; 16 questions)")


def test_write_marked_replaces_only_its_own_part(tmp_path: Path) -> None:
    doc = tmp_path / "report.md"
    script = "benchmarks/demo_moe/shared.py"
    doc.write_text("# r\n\nprose\n<!-- shared: written by benchmarks/demo_moe/shared.py -->\n"
                   "old\n<!-- /shared -->\nafter\n")
    EVAL.write_marked(doc, "shared", script, "| a |\n|---|")
    assert doc.read_text() == ("# r\n\nprose\n<!-- shared: written by "
                               "benchmarks/demo_moe/shared.py -->\n| a |\n|---|\n"
                               "<!-- /shared -->\nafter\n")
    with pytest.raises(ValueError, match=r"lacks the predictor markers '<!-- predictor: written "
                                         r"by benchmarks/demo_moe/routing.py -->'"):
        EVAL.write_marked(doc, "predictor", "benchmarks/demo_moe/routing.py", "x")
