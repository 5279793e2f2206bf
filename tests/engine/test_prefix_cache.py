"""Prefix cache: placement, LRU eviction, stale slots, and outputs identical with and without it
(GQA and MLA families, a second chat turn, a prefix copied from a running request)."""

from __future__ import annotations

import pytest

from hetmoe import LLM
from hetmoe.engine.requests.prefix_cache import Placement, PrefixCache
from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import SamplingParams

PROMPT = "Hello! The harbour town woke slowly that morning."


class FakeCache:
    """The parts of StaticKVCache a PrefixCache reads."""

    def __init__(self, slots: int) -> None:
        self.max_batch = slots
        self.allocations = [0] * slots
        self.lengths = [0] * slots
        self.free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> list[int]:
        return list(self.free)


def test_placement_keeps_in_place_copies_or_evicts_the_least_recent() -> None:
    cache = FakeCache(4)
    prefix = PrefixCache(cache)  # type: ignore[arg-type]
    for slot, tokens in [(0, [1, 2, 3, 4]), (1, [1, 2, 9]), (3, [7, 7])]:
        cache.lengths[slot] = len(tokens)
        prefix.release(slot, tokens)  # released in this order: 2 never used, then 0, 1, 3
    # A match that is all the slot holds: in place (the last prompt token is always prefilled).
    assert prefix.place([1, 2, 3, 4, 5]) == Placement(0, kept=4)
    assert prefix.place([1, 2, 9, 9]) == Placement(1, kept=3)
    # Part of what slot 0 holds: copied into the victim (slot 2, never used), slot 0 kept whole.
    assert prefix.place([1, 2, 3, 8]) == Placement(2, source=0, copied=3)
    assert prefix.place([1, 2, 3, 4]) == Placement(2, source=0, copied=3)
    assert prefix.place([5, 6]) == Placement(2)  # no match
    assert prefix.place([1, 2, 3, 4, 5], reuse=False) == Placement(2)
    cache.free.remove(2)  # now slot 0 is the victim: a match there is used in place
    assert prefix.place([1, 2, 3, 8]) == Placement(0, kept=3)
    assert prefix.place([5, 6]) == Placement(0)
    # Slot 1 busy (a running request): its tokens are copied into the victim.
    cache.free.remove(1)
    assert prefix.place([1, 2, 9, 5]) == Placement(0, source=1, copied=3)
    # A slot allocated elsewhere since (LLM.logits) holds something else: never a match.
    cache.allocations[1] += 1
    assert prefix.place([1, 2, 9, 5]) == Placement(0, kept=2)
    disabled = PrefixCache(cache, enabled=False)  # type: ignore[arg-type]
    disabled.release(3, [7, 7])
    assert disabled.place([7, 7, 7]) == Placement(0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])  # GQA, MLA
def test_second_chat_turn_prefills_only_new_tokens_with_identical_output(llm_of,
                                                                         family: str) -> None:
    llm: LLM = llm_of(family)
    first = [{"role": "user", "content": "Where do the gulls go when it storms?"}]
    reply = llm.chat(first, max_new_tokens=12)
    second = first + [{"role": "assistant", "content": reply.text},
                      {"role": "user", "content": "And the fishermen?"}]
    cached = llm.chat(second, max_new_tokens=16)
    assert cached.cached_tokens >= len(llm.chat_prompt(first))
    llm.scheduler.prefix.enabled = False
    try:
        fresh = llm.chat(second, max_new_tokens=16)
    finally:
        llm.scheduler.prefix.enabled = True
    assert fresh.cached_tokens == 0
    assert cached == fresh  # text, tokens, finish reason: identical


def test_a_running_request_shares_its_prompt(llm_of) -> None:
    llm: LLM = llm_of("qwen3_moe")
    scheduler = llm.scheduler
    long_prompt = llm.encode(PROMPT * 2)
    other = long_prompt[:-3] + llm.encode(" The baker")[1:]
    events: dict[str, list[Event]] = {"a": [], "b": []}
    scheduler.submit(long_prompt, SamplingParams(10), events["a"].append, ignore_eos=True)
    scheduler.run_once()  # a is prefilled and running
    scheduler.submit(other, SamplingParams(6), events["b"].append, ignore_eos=True)
    while scheduler.num_running or scheduler.num_waiting:
        scheduler.run_once()
    assert events["b"][-1].cached_tokens == len(long_prompt) - 3
    shared = [t for e in events["b"] for t in e.token_ids]
    llm.scheduler.prefix.enabled = False
    try:
        alone = llm.generate(other, max_new_tokens=6)
    finally:
        llm.scheduler.prefix.enabled = True
    assert shared[: len(alone.token_ids)] == alone.token_ids


def test_lru_eviction_and_slots_used_elsewhere(tiny_dir) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="torch",
              max_batch=2, progress=False)
    a, b, c = list(range(20, 30)), list(range(40, 48)), list(range(60, 69))  # no common prefix
    first = llm.generate(a, max_new_tokens=4)
    assert first.cached_tokens == 0
    assert llm.generate(b, max_new_tokens=4).cached_tokens == 0
    assert llm.generate(c, max_new_tokens=4).cached_tokens == 0  # evicts a (least recent)
    assert llm.generate(b, max_new_tokens=4).cached_tokens == len(b) - 1
    again = llm.generate(a, max_new_tokens=4)
    assert again.cached_tokens == 0 and again == first
    assert llm.generate(a, max_new_tokens=4).cached_tokens == len(a) - 1

    one = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="torch",
              max_batch=1, progress=False)
    one.generate(a, max_new_tokens=4)
    one.logits(c)  # the one slot now holds c: a's entry is stale
    assert one.generate(a, max_new_tokens=4).cached_tokens == 0
    off = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="torch",
              max_batch=1, progress=False, prefix_cache=False)
    off.generate(a, max_new_tokens=4)
    assert off.generate(a, max_new_tokens=4).cached_tokens == 0
