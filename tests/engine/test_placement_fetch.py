"""Fetch-or-compute (engine/placement/fetch_plan.py, engine/placement/placement_fetch.py; the "GPU"
is the CPU device here): the plan picks nothing at batch 1 or on spread routing, the heavy misses
when a few experts carry many tokens, never more than the staging slots; resident + fetched + CPU
misses equal the CPU alone; prefill and decode with a pool give the tokens of no pool."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from decode_steps import assert_same_greedy, greedy
from test_placement import FORMAT_RTOL, _layer

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import SplitCosts
from hetmoe.engine.placement.fetch_plan import fetch_seconds, least_tokens, plan_fetch
from hetmoe.engine.placement.placement_fetch import StagingPool, staging_bytes
from hetmoe.engine.placement.slots import LayerSlots, expert_bytes

# Per expert of the Qwen3-30B-A3B shape in int8 on an H100 host (tests/engine/test_expert_split.py).
COSTS = SplitCosts(cpu_fixed=49e-6, cpu_token=2.0e-6, gpu_expert=92e-6, gpu_token=0.07e-6,
                   gpu_fixed=70e-6, cpu_call=100e-6, split_fixed=100e-6, split_token=0.16e-6)

EAGER = SplitCosts(cpu_fixed=1e-3, cpu_token=1e-3, gpu_expert=1e-6)
"""A GPU that always pays (least_tokens 1): every miss is a candidate."""


def _tokens(per_expert: dict[int, int], experts: int = 128) -> torch.Tensor:
    out = torch.zeros(experts, dtype=torch.int64)
    for e, n in per_expert.items():
        out[e] = n
    return out


def test_batch_one_and_spread_routing_fetch_nothing() -> None:
    assert least_tokens(COSTS) == 59  # (92 + 70 - 49) / (2 - 0.07) = 58.5 tokens
    assert fetch_seconds(1, COSTS) > COSTS.cpu_fixed + COSTS.cpu_token  # the copy alone is more
    assert plan_fetch(_tokens({e: 1 for e in range(0, 64, 8)}), COSTS, 16) == []  # batch 1
    spread = _tokens({e: 2 for e in range(128)})  # 32 rows x top-8 over 128 experts
    assert plan_fetch(spread, COSTS, 16) == []


def test_heavy_misses_are_fetched_heaviest_first_within_the_slots() -> None:
    skewed = {e: 3 for e in range(128)} | {7: 300, 90: 500, 12: 200, 40: 120, 3: 40}
    tokens = _tokens(skewed)
    assert plan_fetch(tokens, COSTS, 16) == [90, 7, 12, 40]  # 3 (40 tokens) is < least_tokens
    assert plan_fetch(tokens, COSTS, 2) == [90, 7]
    assert plan_fetch(tokens, COSTS, 0) == []


def test_the_gpu_side_never_becomes_the_long_pole() -> None:
    costs = SplitCosts(cpu_fixed=0.0, cpu_token=1.0, gpu_expert=40.0)
    # CPU 150: fetch 0 -> max(100, 40); fetch 1 -> max(50, 80); a third -> max(0, 120) > 80.
    assert plan_fetch(torch.tensor([50, 50, 50]), costs, 8) == [0, 1]
    assert least_tokens(SplitCosts(cpu_fixed=1.0, cpu_token=1.0, gpu_expert=5.0,
                                   gpu_token=1.0)) == float("inf")
    assert least_tokens(EAGER) == 1


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"must be \[E\], found \(2, 2\)"):
        plan_fetch(torch.zeros(2, 2), COSTS, 1)
    with pytest.raises(ValueError, match="slots must be >= 0, got -1"):
        plan_fetch(torch.zeros(4), COSTS, -1)
    with pytest.raises(ValueError, match="tokens per expert must be >= 0"):
        plan_fetch(torch.tensor([1, -2]), COSTS, 1)
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        StagingPool([_layer("int8")], 0, COSTS, torch.device("cpu"))


@pytest.mark.parametrize("fmt", sorted(FORMAT_RTOL))
def test_resident_fetched_and_cpu_misses_equal_the_cpu_alone(fmt: str) -> None:
    moe = _layer(fmt)
    slots = LayerSlots(moe, [3], torch.device("cpu"))
    pool = StagingPool([moe], 2, EAGER, torch.device("cpu"))
    assert pool.bytes == staging_bytes([moe], 2) == 2 * sum(expert_bytes([moe]))  # room ahead
    assert staging_bytes([moe], 0) == 0
    g = torch.Generator().manual_seed(1)
    tokens = 40
    x = torch.randn(tokens, 64, generator=g)
    # Expert 5 on every token, 6 on most, 3 (resident) on some: 5 and 6 are the heavy misses.
    second = torch.where(torch.arange(tokens) % 4 == 0, 3, torch.where(
        torch.arange(tokens) % 4 == 1, torch.randint(0, 3, (tokens,), generator=g), 6))
    ids = torch.stack([torch.full((tokens,), 5), second], 1)  # [T, 2]
    weights = torch.rand(tokens, 2, generator=g)
    slot, cpu_ids = slots.split(ids)
    assert cpu_ids is not None
    fetched, rest = pool.take(slots, cpu_ids)
    assert fetched is not None and (pool.steps, pool.fetched) == (1, 2)
    assert torch.equal(fetched >= 0, torch.isin(ids, torch.tensor([5, 6])))
    assert torch.equal(rest, torch.where(torch.isin(ids, torch.tensor([3, 5, 6])), -1, ids))
    ours = (slots.compute(x, ids, slot, weights) + pool.compute(slots, x, ids, fetched, weights)
            + moe.forward(x, rest, weights))
    ref = moe.forward(x, ids, weights)
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err <= FORMAT_RTOL[fmt], f"{fmt}: relative error {err:.3g}"


def test_a_step_below_least_tokens_plans_nothing() -> None:
    moe = _layer("int8")
    slots = LayerSlots(moe, [], torch.device("cpu"))
    pool = StagingPool([moe], 4, COSTS, torch.device("cpu"))  # least_tokens 59
    ids = torch.tensor([[1, 2]] * 58)
    fetched, rest = pool.take(slots, ids)
    assert fetched is None and rest is ids and pool.steps == 0  # no plan, no host read
    fetched, rest = pool.take(slots, torch.tensor([[1, 2]] * 80))
    # CPU 100 + 2 x 209 us; fetching 1 leaves max(309, 168); fetching 2 as well, max(100, 335).
    assert fetched is not None and pool.fetched == 1
    assert rest.tolist() == [[-1, 2]] * 80 and fetched.tolist() == [[0, -1]] * 80


def _runner(llm: LLM, experts: int, fetch: int, deferred: int = 0) -> ModelRunner:
    """A runner with `experts` resident per layer and `fetch` staging slots (EAGER costs)."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, llm.max_seq_len,
                         EngineConfig(gpu_expert_bytes=0, deferred=deferred))
    assert runner.planner is not None
    runner.planner.costs = EAGER
    runner.place(experts * sum(expert_bytes(runner.overlap.cpu)), fetch_slots=fetch)
    return runner


@pytest.mark.parametrize(("family", "experts", "deferred"),
                         [("qwen3_moe", 0, 0), ("qwen3_moe", 3, 2), ("deepseek_v2", 2, 0),
                          ("mixtral", 1, 0)])
def test_prefill_and_decode_with_fetches_equal_no_fetch(
        engine: Callable[[str, str], LLM], family: str, experts: int, deferred: int) -> None:
    llm = engine(family, "cpu")
    plain = _runner(llm, experts, 0, deferred)
    try:
        assert all(link.pool is None for link in plain.overlap.placed.values())
        ref = greedy(plain, 4)
    finally:
        plain.overlap.detach()
    runner = _runner(llm, experts, 2, deferred)
    try:
        assert runner.placement is not None
        pools = {id(link.pool) for link in runner.overlap.placed.values()}
        assert len(pools) == 1 and len(runner.overlap.placed) == len(runner.placement.layers)
        ours = greedy(runner, 4)
        pool = next(iter(runner.overlap.placed.values())).pool
        assert pool is not None and pool.fetched > 0
        assert pool.fetched <= 2 * pool.steps  # never more than the slots per layer step
    finally:
        runner.overlap.detach()
    assert_same_greedy(ours, ref, f"{family}, {experts} resident")


def test_no_pool_when_every_expert_is_resident(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    runner = _runner(llm, 8, 4)
    try:
        assert runner.placement is not None and runner.placement.everything
        assert all(link.pool is None for link in runner.overlap.placed.values())
    finally:
        runner.overlap.detach()
    with pytest.raises(ValueError, match="fetch_slots must be an integer >= 0, got -1"):
        EngineConfig(fetch_slots=-1)
