"""Admission under a tiny KV budget: requests wait for KV slots, never fail, and each one's
tokens equal its run alone."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hetmoe import LLM
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.step import StepOutput, StepPlan

REQUESTS = 50


@pytest.fixture(scope="module")
def small_llm(tiny_dir: Callable[..., Any]) -> LLM:
    """Two KV slots of 24 tokens: the whole KV budget."""
    return LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="torch",
               max_batch=2, max_seq_len=24, progress=False)


def test_fifty_requests_wait_for_two_slots_and_all_complete(
    small_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(REQUESTS)]
    params = SamplingParams(max_new_tokens=6)
    alone = [small_llm.generate(p, params).token_ids for p in prompts]
    rows: list[int] = []  # sequences per runner step
    waiting: list[int] = []  # requests waiting for a slot at each step
    step = small_llm.runner.step

    def counted(plan: StepPlan) -> StepOutput:
        rows.append(len(plan.slots) + len(plan.prefills))
        waiting.append(small_llm.scheduler.num_waiting)
        return step(plan)

    monkeypatch.setattr(small_llm.runner, "step", counted)
    outs = small_llm.generate(prompts, params)
    monkeypatch.undo()
    assert {o.finish_reason for o in outs} <= {"length", "stop"}  # none failed
    assert [o.token_ids for o in outs] == alone  # batched with others: the same tokens
    assert max(rows) == 2  # never more sequences than slots
    assert max(waiting) == REQUESTS - 2  # all but two waited at first, and none failed
    assert len(small_llm.runner.cache.free_slots) == 2  # every slot given back


def test_fifty_concurrent_callers_of_a_threaded_loop_all_complete(small_llm: LLM) -> None:
    prompts = [[(11 * i + j) % 500 + 1 for j in range(2 + i % 7)] for i in range(REQUESTS)]
    params = SamplingParams(max_new_tokens=4)
    alone = [small_llm.generate(p, params).token_ids for p in prompts]
    small_llm.start_loop(max_queue=REQUESTS)  # a server's loop: callers on their own threads
    try:
        with ThreadPoolExecutor(REQUESTS) as pool:
            outs = list(pool.map(lambda p: small_llm.generate(p, params), prompts))
    finally:
        small_llm.stop_loop()
    assert {o.finish_reason for o in outs} <= {"length", "stop"}
    assert [o.token_ids for o in outs] == alone
