"""KV slots of `LLM(max_batch="auto")` (engine/model/kv_fit.py with no job): the slots that fit,
at most `MAX_AUTO_SLOTS`; the option's values (`EngineConfig.max_batch`); the line logged at load;
an expert budget on the CPU device."""

from __future__ import annotations

import pytest
import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.model.kv_fit import MAX_AUTO_SLOTS, fit_slots, kv_room
from hetmoe.loading.memory_plan import MemoryPlan

GIB = 2**30
TOKEN = 98304  # Qwen3-30B-A3B's bf16 KV bytes per token: 48 layers x 2 x 4 heads x 128 x 2
HOST = MemoryPlan((("routed experts", "host", 3 * GIB), ("other weights", "host", GIB)),
                  40 * GIB, None)


def test_without_a_job_the_slots_are_those_that_fit_at_most_the_cap() -> None:
    room = kv_room(HOST, torch.device("cpu"), "auto")  # 40 GiB less 4 of weights, 2 of margin
    fit = fit_slots(room, TOKEN, 65536, None)
    assert (fit.slots, fit.limit) == (5, f"the most that fit the 34.00 GiB the host has for KV "
                                         f"({room.explain()})")
    assert fit.auto_line() == ("KV slots: 5 (auto: 34.00 GiB free for KV on the host, 6144.00 "
                               f"MiB per slot of 65536 tokens; slots: {fit.limit})")
    short = fit_slots(room, TOKEN, 1024, None)  # 362 would fit
    assert (short.slots, short.limit) == (MAX_AUTO_SLOTS, "the cap of 256 (max_batch N for more)")


def test_without_a_job_not_one_slot_names_max_seq_len() -> None:
    room = kv_room(HOST, torch.device("cpu"), "auto")
    with pytest.raises(ValueError, match=r"one slot of 524288 tokens takes 51539607552 bytes .*"
                                         r"; lower max_seq_len, or free memory$"):
        fit_slots(room, TOKEN, 524288, None)


def test_the_option_takes_auto_or_a_positive_integer() -> None:
    assert EngineConfig().max_batch == 8  # the default stays a fixed count
    assert EngineConfig(max_batch="auto").max_batch == "auto"
    assert EngineConfig.from_options(max_batch=300).max_batch == 300  # beyond auto's cap
    for bad in ("8", "AUTO", 0, -1, 1.0, False, None):
        with pytest.raises(ValueError, match=rf"^option max_batch must be 'auto' or a positive "
                                             rf"integer, got {bad!r}$"):
            EngineConfig(max_batch=bad)  # type: ignore[arg-type]


def test_on_the_cpu_device_an_expert_budget_is_host_memory_and_counts_against_kv() -> None:
    # No GPU, yet the runner still places the budget's resident expert copies, on the host.
    room = kv_room(HOST, torch.device("cpu"), 5 * GIB)
    assert (room.place, room.bytes, room.shared) == ("host", 29 * GIB, False)
    assert room.explain().endswith(f", {2 * GIB} of margin, {5 * GIB} of --gpu-expert-gib")
    assert kv_room(HOST, torch.device("cpu"), 0).bytes == 34 * GIB  # 0: nothing resident
    assert kv_room(HOST, torch.device("cpu"), 40 * GIB).bytes == 0  # never below none
