"""A long prompt admitted while others decode is prefilled a chunk per step, each step also
decoding the running requests; outputs equal the whole-prompt prefill."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from live_server import tiny_llm
from test_scheduler import Collector

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Scheduler
from hetmoe.engine.step import StepPlan

LONG = list(range(5, 45))  # 40 prompt tokens


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe: Path, one_torch_thread: None) -> LLM:
    return tiny_llm(tiny_qwen3_moe, max_batch=2, max_seq_len=96)


def run(llm: LLM, chunk: int | None) -> tuple[list[list[int]], list[tuple[tuple[int, ...], int]]]:
    """A short request decoding, then LONG admitted; both greedy. Returns both token lists and
    the runner steps in order: (prompt tokens of each prefill chunk, decode rows)."""
    runner = llm.runner
    before = runner.config
    runner.config = dataclasses.replace(before, prefill_chunk=chunk)
    calls: list[tuple[tuple[int, ...], int]] = []
    step = runner.step

    def counted_step(plan: StepPlan) -> Any:
        calls.append((tuple(len(c.token_ids) for c in plan.prefills), len(plan.slots)))
        return step(plan)

    runner.step = counted_step  # type: ignore[method-assign]
    scheduler = Scheduler(runner, llm.decode, llm.eos_token_ids, threaded=False,
                          prefix_cache=False)
    try:
        sinks = [Collector(), Collector()]
        scheduler.submit([3, 4, 5], SamplingParams(20), sinks[0], ignore_eos=True)
        for _ in range(3):
            scheduler.run_once()  # the short request decodes alone
        scheduler.submit(LONG, SamplingParams(6), sinks[1], ignore_eos=True)
        while scheduler.num_running or scheduler.num_waiting:
            scheduler.run_once()
        return [s.token_ids for s in sinks], calls
    finally:
        scheduler.stop()
        del runner.step
        runner.config = before


def test_a_long_prompt_is_prefilled_between_decode_steps(llm: LLM) -> None:
    whole_tokens, whole_calls = run(llm, None)
    tokens, calls = run(llm, 16)
    assert tokens == whole_tokens  # chunks attend to what earlier chunks cached: exact
    assert whole_calls[:4] == [((3,), 0), ((), 1), ((), 1), ((40,), 1)]
    # One chunk per step, each step also decoding the running request.
    assert calls[:6] == [((3,), 0), ((), 1), ((), 1), ((16,), 1), ((16,), 1), ((8,), 1)]
    assert calls[6] == ((), 2)
    assert len(tokens[0]) == 20 and len(tokens[1]) == 6


def test_a_prompt_with_nothing_decoding_is_prefilled_at_once(llm: LLM) -> None:
    out = llm.generate(LONG, max_new_tokens=3)
    runner = llm.runner
    runner.config = dataclasses.replace(runner.config, prefill_chunk=8)
    try:
        assert llm.generate(LONG, max_new_tokens=3).token_ids == out.token_ids
    finally:
        runner.config = dataclasses.replace(runner.config, prefill_chunk=4096)


def test_prefill_chunk_is_checked() -> None:
    assert EngineConfig(prefill_chunk=None).prefill_chunk is None
    with pytest.raises(ValueError, match="prefill_chunk must be None or a positive integer"):
        EngineConfig(prefill_chunk=0)
