"""benchmarks/demo_moe/quality.py's "defer misses" mode on a baby model: the link defers each
token's lowest-scored misses, the same as the paper's order with nothing resident and nothing
with every expert resident; resident experts ranked by training routing counts."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from bench_script import load_script

from hetmoe import LLM

PROMPT = [5, 9, 33, 100, 7, 11, 2]


def test_the_misses_link_defers_the_lowest_scored_misses() -> None:
    script = load_script("demo_moe/quality.py")
    moe = SimpleNamespace(experts=SimpleNamespace(spec=SimpleNamespace(hidden_size=4)),
                          gate=SimpleNamespace(config=SimpleNamespace(top_k=4)))
    resident = torch.tensor([True, False, True, False, False, False, False, False])
    link = script.MissesLink(moe, resident)
    ids = torch.tensor([[1, 0, 3, 4], [0, 2, 5, 1]])
    now, late = link.split(ids, 2)
    assert now.tolist() == [[1, 0, -1, -1], [0, 2, -1, -1]]
    assert late.tolist() == [[-1, -1, 3, 4], [-1, -1, 5, 1]]
    assert (link.deferred_pairs, link.tokens) == (4, 2)
    now, late = link.split(ids, 1)  # at most d: the lowest-scored miss only
    assert late.tolist() == [[-1, -1, -1, 4], [-1, -1, -1, 1]]


def _logits(script: object, llm: LLM, mode: str, d: int,
            resident: list[torch.Tensor] | None = None) -> torch.Tensor:
    runner = llm.runner
    with script.attached(llm, mode, d, resident) as step:  # type: ignore[attr-defined]
        runner.lengths[0] = 0
        with step.phase(decoding=True):
            return runner.prefill_logits(0, PROMPT)  # [T, V], each position as if decoded


def test_defer_misses_at_nothing_and_everything_resident(
        engine: Callable[[str, str], LLM]) -> None:
    script = load_script("demo_moe/quality.py")
    llm = engine("qwen3_moe", "torch")  # top-4 of 8
    layers = len(script.moe_layers(llm.model))
    none = [torch.zeros(8, dtype=torch.bool)] * layers
    every = [torch.ones(8, dtype=torch.bool)] * layers
    some = [torch.arange(8) < 4] * layers
    exact = _logits(script, llm, "defer", 0)
    score = _logits(script, llm, "defer", 2)
    assert torch.equal(_logits(script, llm, "defer misses", 2, none), score)
    assert torch.equal(_logits(script, llm, "defer misses", 2, every), exact)
    partial = _logits(script, llm, "defer misses", 2, some)
    assert (partial - score).abs().max() > 1e-3 and (partial - exact).abs().max() > 1e-3


def test_resident_sets_rank_the_training_routing(engine: Callable[[str, str], LLM]) -> None:
    script = load_script("demo_moe/quality.py")
    llm = engine("qwen3_moe", "torch")
    layers = len(script.moe_layers(llm.model))
    picks = [torch.tensor([[7, 3], [7, 5], [7, 3]])] * layers  # counts: 7 x3, 3 x2, 5 x1
    script.record_picks = lambda *_: picks
    script.token_windows = lambda texts, window, count: [[1, 2, 3]] * count
    sets = script.resident_sets(llm, llm.runner, 16, 2, [0.25, 0.375])
    assert [int(i) for i in sets[0.25][0].nonzero()] == [3, 7]
    assert [int(i) for i in sets[0.375][0].nonzero()] == [3, 5, 7]


def test_a_resident_share_outside_0_1_is_named(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any model work: a negative share would slice the ranking from its end
    (order[:-2]: most experts resident)."""
    script = load_script("demo_moe/quality.py")
    monkeypatch.setattr(script, "measure", lambda *_: pytest.fail("measured a bad share"))
    for value in ("-0.25", "0.5,1.5"):
        with pytest.raises(SystemExit):
            script.main(["--resident-share", value])
        bad = value.split(",")[-1]
        assert f"argument --resident-share: shares are in [0, 1], got {bad}" in \
            capsys.readouterr().err
