"""The scheduler's requests of n choices: admitted together, one prefill, cancelled together."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import tiny_llm

from hetmoe import LLM
from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Scheduler
from hetmoe.engine.step import StepPlan


class Choices:
    """A sink for every choice of one request."""

    def __init__(self, n: int) -> None:
        self.events: list[Event] = []
        self.left = n
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def of(self, index: int) -> list[Event]:
        return [e for e in self.events if e.index == index]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe: Path, one_torch_thread: None) -> LLM:
    return tiny_llm(tiny_qwen3_moe, max_batch=3, max_seq_len=64)


@pytest.fixture
def scheduler(llm: LLM) -> Iterator[Scheduler]:
    running = Scheduler(llm.runner, llm.decode, llm.eos_token_ids, max_queue=4, threaded=False)
    yield running
    running.stop()


def drain(scheduler: Scheduler) -> None:
    while scheduler.num_running or scheduler.num_waiting:
        scheduler.run_once()


def test_more_choices_than_slots_is_refused(llm: LLM, scheduler: Scheduler) -> None:
    with pytest.raises(ValueError, match=r"n=4 choices need as many KV slots; there are 3"):
        scheduler.submit(llm.encode("Hi"), SamplingParams(4), Choices(4), n=4)


def test_a_group_waits_for_its_slots_and_shares_one_prefill(
    llm: LLM, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    single = Choices(1)
    scheduler.submit(llm.encode("Hello"), SamplingParams(6), single, ignore_eos=True)
    scheduler.run_once()  # one slot busy: a group of 3 must wait
    group = Choices(3)
    prompt = llm.encode("The harbour town")
    params = SamplingParams(5, temperature=1.0, seed=21)
    scheduler.submit(prompt, params, group, ignore_eos=True, n=3)
    assert scheduler.num_waiting == 3
    prefilled: list[int] = []
    step = llm.runner.step

    def counted(plan: StepPlan) -> object:
        prefilled.extend(len(chunk.token_ids) for chunk in plan.prefills)
        return step(plan)

    monkeypatch.setattr(llm.runner, "step", counted)
    drain(scheduler)
    assert len(prefilled) == 1  # the group's one prefill
    assert single.done.is_set() and group.done.is_set()
    tokens = [[t for e in group.of(i) for t in e.token_ids] for i in range(3)]
    assert all(len(t) == 5 for t in tokens) and len({tuple(t) for t in tokens}) == 3
    for i in range(3):  # choice i is the request with seed + i alone
        alone = Choices(1)
        scheduler.submit(prompt, SamplingParams(5, temperature=1.0, seed=21 + i), alone,
                         ignore_eos=True)
        drain(scheduler)
        assert [t for e in alone.events for t in e.token_ids] == tokens[i]


def test_cancel_ends_every_choice_and_frees_their_slots(llm: LLM, scheduler: Scheduler) -> None:
    group = Choices(3)
    handle = scheduler.submit(llm.encode("Hi"), SamplingParams(40), group, ignore_eos=True, n=3)
    scheduler.run_once()
    handle.cancel()
    drain(scheduler)
    finals = [e for e in group.events if e.finish_reason is not None]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    assert {e.finish_reason for e in finals} == {"cancelled"}
    assert len(llm.runner.cache.free_slots) == 3


def test_a_failed_prefill_fails_every_choice(llm: LLM, scheduler: Scheduler) -> None:
    group = Choices(2)
    scheduler.submit([1, 9999], SamplingParams(4), group, n=2)
    drain(scheduler)
    assert [(e.index, e.finish_reason) for e in group.events] == [(0, "error"), (1, "error")]
    assert len(llm.runner.cache.free_slots) == 3
