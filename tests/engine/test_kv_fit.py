"""KV slots from the memory a model leaves (engine/model/kv_fit.py): on the GPU the room of the
`auto` expert budget, shared with resident experts without claiming a byte twice; on the host
MemAvailable less the weights and a margin; the cap; the error naming the bytes."""

from __future__ import annotations

import pytest
import torch

from hetmoe.engine.model.kv_fit import MAX_AUTO_SLOTS, fit_slots, kv_room
from hetmoe.engine.placement.placement_plan import auto_room, planned_placement
from hetmoe.loading.memory_plan import MemoryPlan

GIB = 2**30
CUDA = torch.device("cuda", 0)
LAYERS = ((128, 6 * 2**20),) * 48  # 48 layers of 128 experts of 6 MiB
TOKEN = 98304  # Qwen3-30B-A3B's bf16 KV bytes per token: 48 layers x 2 x 4 heads x 128 x 2


def gpu_plan(free: int = 23 * GIB, kv: int = 0) -> MemoryPlan:
    rows = (("routed experts", "host", 36 * GIB), ("other weights", "gpu", 2 * GIB),
            ("KV cache", "gpu", kv))
    return MemoryPlan(tuple(r for r in rows if r[2]), 100 * GIB, free, LAYERS, 24 * GIB)


def test_the_gpu_room_is_the_auto_expert_room_and_experts_get_what_kv_leaves() -> None:
    room = kv_room(gpu_plan(), CUDA, "auto")
    # 23 GiB free, less 2 GiB of weights, staging (2 x 0.75 GiB: the packed kernels need no
    # bf16 copy), graphs, 5 % of 24 GiB
    want = 21 * GIB - 3 * GIB // 2 - GIB // 2 - int(0.05 * 24 * GIB)
    assert (room.place, room.device, room.bytes) == ("GPU", "cuda:0", want)
    assert room.explain() == (f"{23 * GIB} bytes free, less {2 * GIB} of other weights, "
                              f"{3 * GIB // 2} of prefill staging, {GIB // 2} of CUDA graphs, "
                              f"{int(0.05 * 24 * GIB)} of margin")
    fit = fit_slots(room, TOKEN, 1024, wanted=1000)
    assert fit.slots == want // (1024 * TOKEN) == 189
    assert fit.limit == (f"the most that fit the {want / GIB:.2f} GiB the GPU has for KV, of "
                         f"the job's 1000 sequences ({room.explain()}; GPU experts "
                         "--gpu-expert-gib auto take what KV leaves)")
    # Once the cache is allocated, `auto` experts take exactly what it left.
    placed = planned_placement(gpu_plan(kv=fit.kv_bytes))
    assert placed is not None and placed.budget == room.bytes - fit.kv_bytes
    assert auto_room(gpu_plan(kv=fit.kv_bytes)) + fit.kv_bytes == room.bytes


def test_an_explicit_expert_budget_is_set_aside_before_the_kv_cache() -> None:
    auto = kv_room(gpu_plan(), CUDA, "auto")
    room = kv_room(gpu_plan(), CUDA, 5 * GIB)
    assert room.bytes == auto.bytes - 5 * GIB
    assert room.explain().endswith(f", {5 * GIB} of --gpu-expert-gib")
    fit = fit_slots(room, TOKEN, 1024, wanted=1000)
    assert fit.slots == room.bytes // (1024 * TOKEN) == 136
    # the experts' bytes are fixed: nothing is left to them after the KV cache
    assert fit.limit == (f"the most that fit the {room.bytes / GIB:.2f} GiB the GPU has for "
                         f"KV, of the job's 1000 sequences ({room.explain()})")


def test_slots_are_the_jobs_sequences_at_most_the_cap_or_the_asked_number() -> None:
    room = kv_room(gpu_plan(free=70 * GIB), CUDA, "auto")
    few = fit_slots(room, TOKEN, 768, wanted=40)
    assert (few.slots, few.window, few.limit) == (40, 768, "the job's 40 sequences")
    assert few.kv_bytes == 40 * 768 * TOKEN
    assert few.describe() == (f"40 slots x 768 tokens = {few.kv_bytes / GIB:.2f} GiB of KV "
                              f"({few.kv_bytes} bytes) on the GPU (cuda:0); slots: the job's "
                              "40 sequences")
    many = fit_slots(room, TOKEN, 768, wanted=5000)
    assert room.bytes // (768 * TOKEN) > MAX_AUTO_SLOTS == many.slots == 256
    assert many.limit == ("the cap of 256 (--max-batch N for more), of the job's 5000 "
                          "sequences")
    asked = fit_slots(room, TOKEN, 768, wanted=5000, asked=300)
    assert (asked.slots, asked.limit) == (300, "--max-batch 300")
    none = fit_slots(room, TOKEN, 768, wanted=0)  # only lines that their routes refuse
    assert (none.slots, none.limit) == (1, "one: no line of the job holds a slot (their routes "
                                           "refuse them)")


def test_on_the_host_the_room_is_available_memory_less_weights_and_margin() -> None:
    rows = (("routed experts", "host", 3 * GIB), ("other weights", "host", GIB))
    mem = MemoryPlan(rows, 40 * GIB, None)
    room = kv_room(mem, torch.device("cpu"), "auto")
    assert (room.place, room.bytes) == ("host", 36 * GIB - 2 * GIB)  # margin: 5 % of 40 GiB
    assert room.explain() == (f"{40 * GIB} bytes available, less {4 * GIB} of routed experts "
                              f"and other weights, {2 * GIB} of margin")
    # On the CPU device resident "GPU" experts are host memory too.
    assert kv_room(mem, torch.device("cpu"), GIB).bytes == 33 * GIB
    fit = fit_slots(room, TOKEN, 65536, wanted=100)  # no GPU: no experts take what KV leaves
    assert (fit.slots, fit.limit) == (5, f"the most that fit the 34.00 GiB the host has for KV, "
                                         f"of the job's 100 sequences ({room.explain()})")


def test_not_even_one_slot_is_an_error_naming_the_bytes() -> None:
    claims = 2 * GIB + 3 * GIB // 2 + GIB // 2 + int(0.05 * 24 * GIB)  # 5.2 GiB
    room = kv_room(gpu_plan(free=3 * GIB), CUDA, "auto")
    assert room.bytes == 0  # 3 GiB free: weights and reserves take more, none left to stage
    with pytest.raises(ValueError) as error:
        fit_slots(room, TOKEN, 4096, wanted=10)
    assert str(error.value) == (
        f"not even one KV slot fits: one slot of 4096 tokens takes {4096 * TOKEN} bytes "
        f"({TOKEN} bytes per token), and the GPU (cuda:0) has 0 bytes for the KV cache "
        f"({room.explain()}); lower --max-seq-len or the lines' max_tokens, or free memory")
    small = kv_room(gpu_plan(free=claims + 4096 * TOKEN - 1), CUDA, "auto")
    assert small.bytes == 4096 * TOKEN - 1
    with pytest.raises(ValueError, match=f"has {small.bytes} bytes for the KV cache"):
        fit_slots(small, TOKEN, 4096, wanted=10)
