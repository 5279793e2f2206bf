"""Expert Deferral's "misses" order (ops/deferral.py): the deferred set, the reorder that makes the
CPU link's last d slots that set, `PlacementLink` under it (the "GPU" is the CPU device here),
decode against the reference formula with budgets 0 / partial / all, and "misses" as the
default order (with no expert resident the score order's deferred set)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from decode_steps import SAME_BACKEND_ATOL, assert_same_greedy, greedy
from deferral_reference import DeferralReference
from test_placement_fetch import EAGER

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.placement_link import PlacementLink
from hetmoe.engine.placement.placement_plan import PlacementPlan
from hetmoe.engine.placement.slots import LayerSlots, Placement, expert_bytes
from hetmoe.experts.cpu_moe import CpuMoE
from hetmoe.ops.deferral import check_defer_order, deferred_misses, misses_last, split_ids
from hetmoe.ops.moe import moe_layers

CROSS_BACKEND_ATOL = 0.08  # C++ CPU kernels (bf16 activations) against torch experts in fp32


def test_the_deferred_misses_are_each_rows_lowest_scored_misses() -> None:
    miss = torch.tensor([[True, False, True, True], [False, False, False, True],
                         [False, False, False, False]])
    assert deferred_misses(miss, 2).tolist() == [[False, False, True, True],
                                                 [False, False, False, True],
                                                 [False, False, False, False]]
    assert deferred_misses(miss, 0).sum() == 0
    assert deferred_misses(miss, 3).tolist()[0] == [True, False, True, True]


def test_misses_last_puts_the_deferred_misses_in_the_last_slots() -> None:
    ids = torch.tensor([[7, 3, 5, 1], [0, 2, 4, 6]])
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1]])
    miss = torch.tensor([[True, False, True, True], [False, False, False, True]])
    ordered, w = misses_last(ids, weights, miss)
    assert ordered.tolist() == [[3, 7, 5, 1], [0, 2, 4, 6]]
    assert torch.equal(w[0], weights[0, [1, 0, 2, 3]]) and torch.equal(w[1], weights[1])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # the CPU's late ids (residents -1) are exactly the deferred misses
        ids = torch.stack([torch.randperm(16, generator=g)[:6] for _ in range(5)])
        miss = torch.rand(5, 6, generator=g) < 0.5
        for d in range(5):
            ordered, ordered_miss = misses_last(ids, miss.float(), miss)  # the mask follows
            cpu = torch.where(ordered_miss > 0, ordered, -1)
            late = split_ids(cpu, d)[1]
            want = torch.where(deferred_misses(miss, d), ids, -1)
            for row in range(5):
                assert sorted(late[row][late[row] >= 0].tolist()) == \
                    sorted(want[row][want[row] >= 0].tolist())
                assert int((late[row] >= 0).sum()) == min(d, int(miss[row].sum()))


def test_a_bad_order_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"^option defer_order must be one of score, misses, "
                       r"got 'lowest'$"):
        EngineConfig(defer_order="lowest")
    with pytest.raises(ValueError, match=r"^defer_order must be one of score, misses \(which "
                       r"experts Expert Deferral defers\), got 'Misses'$"):
        check_defer_order("Misses")


class Recording:
    """A CPU link computing synchronously on a `CpuMoE`, recording what it was started with."""

    def __init__(self, moe: CpuMoE) -> None:
        self.moe = moe
        self.started: list[tuple[torch.Tensor, int]] = []  # (ids, deferred)
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        self.started.append((ids.clone(), deferred))
        now, late = split_ids(ids, deferred)
        self._out = (self.moe.forward(x, now, weights), self.moe.forward(x, late, weights))

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        raise AssertionError("not used here")

    def finish(self) -> torch.Tensor:
        assert self._out is not None
        return self._out[0]

    def finish_late(self) -> torch.Tensor:
        assert self._out is not None
        return self._out[1]


def _moe() -> CpuMoE:
    e, h, i = 8, 64, 96
    g = torch.Generator().manual_seed(0)
    moe = CpuMoE(e, h, i, weight_format="bf16")
    gate, up = (torch.randn(e, i, h, generator=g) * 0.1 for _ in range(2))
    moe.load(gate.bfloat16(), up.bfloat16(), (torch.randn(e, h, i, generator=g) * 0.1).bfloat16())
    return moe


def _inputs(tokens: int = 6, k: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).sort(descending=True).values
    return x, ids, weights


@pytest.mark.parametrize("resident", [[], [3, 0, 5], list(range(8))])
@pytest.mark.parametrize("deferred", [0, 1, 2])
def test_placement_link_defers_the_lowest_scored_misses(resident: list[int],
                                                        deferred: int) -> None:
    moe = _moe()
    x, ids, weights = _inputs()
    slots = LayerSlots(moe, resident, torch.device("cpu"))
    links = {}
    for order in ("score", "misses"):
        cpu = Recording(moe)
        link = links[order] = PlacementLink(cpu, slots, 64, 4, defer_order=order)
        link.start(x, ids, weights, deferred)
        now = link.finish()
        late = link.finish_late() if deferred else None
        miss = ~torch.isin(ids, torch.tensor(resident, dtype=torch.int64))
        mask = deferred_misses(miss, deferred) if order == "misses" else \
            torch.arange(4) >= 4 - deferred
        want_now = moe.forward(x, torch.where(mask, -1, ids), weights)
        err = (now - want_now).abs().max().item()
        assert err <= 1e-5 * want_now.abs().max().item(), f"{order}, d={deferred}: {err:.3g}"
        if len(resident) == 8:  # every expert resident: no CPU job at all
            assert cpu.started == []
        if order == "misses" and (len(resident) == 8 or not deferred):
            assert late is None  # nothing deferred: no late term
        elif deferred:
            assert late is not None
            want_late = moe.forward(x, torch.where(mask, ids, -1), weights)
            assert (late - want_late).abs().max().item() <= 1e-5 * want_late.abs().max().item()
        if cpu.started and order == "misses":
            cpu_ids, d = cpu.started[0]
            assert d == deferred
            late_ids = split_ids(cpu_ids, deferred)[1]  # each row: min(d, its misses)
            assert torch.equal((late_ids >= 0).sum(-1), mask.sum(-1))
            assert torch.equal(torch.where(mask, ids, -1).sort(-1).values,
                               late_ids.sort(-1).values)
        if not resident and cpu.started:  # budget 0: the ids the score order defers
            assert torch.equal(cpu.started[0][0], ids)


def test_every_expert_resident_queues_no_late_work() -> None:
    moe = _moe()
    x, ids, weights = _inputs()
    slots = LayerSlots(moe, list(range(8)), torch.device("cpu"))
    rows: list[int] = []
    compute = slots.compute

    def counted(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return compute(x, *args)

    slots.compute = counted  # type: ignore[method-assign,assignment]
    outs = {}
    for order, d in (("score", 0), ("misses", 2), ("score", 2)):
        link = PlacementLink(Recording(moe), slots, 64, 4, defer_order=order)
        link.start(x, ids, weights, d)
        outs[order, d] = link.finish()
    assert rows == [6, 6, 12]  # the score order computes the rows twice (now and late)
    assert torch.equal(outs["misses", 2], outs["score", 0])


def _per_layer(llm: LLM) -> int:
    """Packed bytes of one expert in every MoE layer (a budget of n of them: n per layer)."""
    assert llm.runner.overlap is not None
    return int(sum(expert_bytes(llm.runner.overlap.cpu)))


def _runner(llm: LLM, budget: int, deferred: int, order: str) -> ModelRunner:
    return ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                       EngineConfig(gpu_expert_bytes=budget, deferred=deferred,
                                    defer_order=order))


@pytest.mark.parametrize("experts", [0, 3, 8])  # budgets: none, partial, every expert
def test_misses_decode_equals_the_reference(engine: Callable[[str, str], LLM],
                                            experts: int) -> None:
    cpu, torch_llm = engine("qwen3_moe", "cpu"), engine("qwen3_moe", "torch")  # top-4 of 8
    per_layer = _per_layer(cpu)
    for d in (0, 1, 2):
        runner = _runner(cpu, experts * per_layer, d, "misses")
        try:
            placement = runner.placement
            resident = [list(s) for s in placement.plan.resident] if placement is not None \
                else [[] for _ in moe_layers(cpu.model)]
            ours = greedy(runner, 4)
        finally:
            runner.overlap.detach()  # type: ignore[union-attr]
        same = greedy(cpu.runner, 4, DeferralReference(cpu.model, d, resident))
        other = greedy(torch_llm.runner, 4, DeferralReference(torch_llm.model, d, resident))
        label = f"{experts} resident, d={d}"
        assert_same_greedy(ours, same, label)
        assert ours[0] == other[0], label
        delta = max((a - b).abs().max().item() for a, b in zip(ours[1], other[1], strict=True))
        assert delta <= CROSS_BACKEND_ATOL, f"{label}: |Δ| vs torch reference {delta:.3g}"


def test_the_three_consequences_on_decode(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    per_layer = _per_layer(llm)
    runs = {}
    for experts, d, order in ((0, 2, "score"), (0, 2, "misses"), (8, 0, "misses"),
                              (8, 2, "misses"), (3, 2, "score"), (3, 2, "misses")):
        runner = _runner(llm, experts * per_layer, d, order)
        try:
            runs[experts, d, order] = greedy(runner, 4)
        finally:
            runner.overlap.detach()  # type: ignore[union-attr]
    for a, b in zip(runs[0, 2, "score"][1], runs[0, 2, "misses"][1], strict=True):
        assert torch.equal(a, b)  # budget 0: the same experts deferred
    for a, b in zip(runs[8, 2, "misses"][1], runs[8, 0, "misses"][1], strict=True):
        assert torch.equal(a, b)  # every expert resident: nothing deferred
    moved = max((a - b).abs().max().item()
                for a, b in zip(runs[3, 2, "score"][1], runs[3, 2, "misses"][1], strict=True))
    assert moved > SAME_BACKEND_ATOL  # partial: another set deferred (the test is not vacuous)


def test_the_order_is_changed_where_graphs_are_reset(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    per_layer = _per_layer(llm)
    runner = _runner(llm, 3 * per_layer, 2, "score")
    try:
        overlap = runner.overlap
        assert overlap is not None and overlap.placed
        runner.reset_graphs(defer_order="misses")
        assert {link.defer_order for link in overlap.placed.values()} == {"misses"}
        with pytest.raises(ValueError, match="defer_order must be one of score, misses"):
            runner.reset_graphs(defer_order="all")
        assert overlap.defer_order == "misses"
        runner.place(4 * per_layer)  # a new placement keeps the order
        assert {link.defer_order for link in overlap.placed.values()} == {"misses"}
    finally:
        runner.overlap.detach()  # type: ignore[union-attr]


def test_the_order_is_said_where_the_choice_is(tiny_dir: Callable[..., object]) -> None:
    from typer.testing import CliRunner

    from hetmoe.bench.bench_config import BenchConfig
    from hetmoe.cli import app
    from hetmoe.cli_convert import DEFER_ORDER_LINE
    from hetmoe.engine.model.deferral_auto import DeferralChoice

    assert DeferralChoice(2, "why").describe() == "deferred auto: 2 (why)"  # the default order
    assert DeferralChoice(2, "why", order="score").describe() == \
        "deferred auto: 2 in the score order (why)"
    assert DeferralChoice(0, "why", order="score").describe() == "deferred auto: 0 (why)"
    done = CliRunner().invoke(app, ["info", str(tiny_dir("qwen3_moe")), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert f"\n{DEFER_ORDER_LINE}\n" in done.output
    with pytest.raises(ValueError, match=r"^defer_order must be one of score, misses, got 'x'$"):
        BenchConfig(shape="qwen3-30b-a3b", defer_order="x")


def test_misses_is_the_default_order_everywhere() -> None:
    from hetmoe.bench.bench_config import BenchConfig
    from hetmoe.cli import bench
    from hetmoe.cli_convert import DEFER_ORDER_LINE
    from hetmoe.cli_engine import EngineOptions
    from hetmoe.engine.executor.overlap import MoEOverlap
    from hetmoe.engine.model.deferral_auto import DeferralChoice, StepTimes

    defaults = {
        "EngineConfig": EngineConfig().defer_order,
        "MoEOverlap": inspect.signature(MoEOverlap).parameters["defer_order"].default,
        "PlacementLink": inspect.signature(PlacementLink).parameters["defer_order"].default,
        "BenchConfig": BenchConfig(shape="qwen3-30b-a3b").defer_order,
        "hetmoe bench": inspect.signature(bench).parameters["defer_order"].default,
        "EngineOptions": EngineOptions().defer_order,
        "StepTimes": StepTimes(1.0, 0.5, 4, 8).order,
        "DeferralChoice": DeferralChoice(0, "why").order,
    }
    assert defaults == dict.fromkeys(defaults, "misses")
    assert DEFER_ORDER_LINE.startswith("deferral order: misses by default")


@pytest.mark.parametrize("fetch", [0, 2])
def test_without_resident_experts_the_default_defers_the_score_orders_set(
        engine: Callable[[str, str], LLM], fetch: int) -> None:
    """No expert resident, the default order decodes bit-equal to the score order: CPU-only
    (`gpu_expert_bytes` auto on the CPU device: no placement, the CPU links' own rule) and budget
    0 with a fetch pool (every layer a `PlacementLink` with no resident slot, which reorders the
    slots misses last: all are misses, so nothing moves)."""
    llm = engine("qwen3_moe", "cpu")
    runs = {}
    for order in ("default", "score"):
        config = EngineConfig(deferred=2) if order == "default" else \
            EngineConfig(deferred=2, defer_order=order)
        runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len, config)
        try:
            overlap = runner.overlap
            assert overlap is not None and runner.placement is None and not overlap.placed
            if fetch:
                assert runner.planner is not None
                runner.planner.costs = EAGER  # every miss a fetch candidate
                runner.place(0, fetch_slots=fetch)
                links = list(overlap.placed.values())
                assert len(links) == len(overlap.layers)
                assert all(not link.slots.slots for link in links)
                assert all(link._reorders(2) == (order == "default") for link in links)
            runs[order] = greedy(runner, 4)
            if fetch:
                assert links[0].pool is not None and links[0].pool.fetched > 0
        finally:
            overlap.detach()  # type: ignore[union-attr]
    assert runs["default"][0] == runs["score"][0]
    for a, b in zip(runs["default"][1], runs["score"][1], strict=True):
        assert torch.equal(a, b)


def test_a_refused_order_changes_no_setting(engine: Callable[[str, str], LLM]) -> None:
    """reset_graphs(deferred, order) with a bad order leaves the count as it was too: a count
    set while the graphs of the old one stayed would replay other settings than the eager
    steps run."""
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 3 * _per_layer(llm), 0, "score")
    try:
        with pytest.raises(ValueError, match="defer_order must be one of score, misses"):
            runner.reset_graphs(2, "Misses")
        overlap = runner.overlap
        assert overlap is not None
        assert (overlap.deferred, overlap.defer_order) == (0, "score")
    finally:
        runner.overlap.detach()  # type: ignore[union-attr]


def place_pattern(runner: ModelRunner, pattern: str) -> list[list[int]]:
    """Places per MoE layer by `pattern` (repeated): f every expert, p experts 1, 4, 6, n none;
    the resident ids per layer."""
    overlap = runner.overlap
    assert overlap is not None
    e = [m.num_experts for m in overlap.cpu]
    kinds = [pattern[i % len(pattern)] for i in range(len(e))]
    resident = [list(range(n)) if c == "f" else [1, 4, 6] if c == "p" else []
                for n, c in zip(e, kinds, strict=True)]
    plan = PlacementPlan(sum(expert_bytes(overlap.cpu)) * max(e), tuple(expert_bytes(overlap.cpu)),
                         tuple(e), tuple(tuple(r) for r in resident))
    runner.placement = Placement(overlap.cpu, plan, runner.device)
    overlap.place(runner.placement)  # and the prefill planner, as ModelRunner.place does
    assert runner.planner is not None
    runner.planner.place(runner.placement)
    return resident


@pytest.mark.parametrize("pattern", ["fpf", "pfp", "ffp", "pff", "npn", "fnf"])
def test_layers_deferring_nothing_between_others_keep_the_carry(
        tiny_dir: Callable[..., object], pattern: str) -> None:
    """Five MoE layers, each every expert, some or none resident: a layer that defers nothing
    (all resident; the first, last or between partial ones) passes no late term and takes the
    previous layer's, as the reference formula does."""
    llm = LLM(tiny_dir("qwen3_moe", num_layers=5), device="cpu", dtype="float32",
              experts="cpu", progress=False, max_seq_len=64)
    for d in (1, 2):
        runner = _runner(llm, 0, d, "misses")
        try:
            resident = place_pattern(runner, pattern)
            ours = greedy(runner, 4)
        finally:
            runner.overlap.detach()  # type: ignore[union-attr]
        same = greedy(llm.runner, 4, DeferralReference(llm.model, d, resident))
        assert_same_greedy(ours, same, f"{pattern} d={d}")
