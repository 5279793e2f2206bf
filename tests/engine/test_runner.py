"""ModelRunner: batched decode over slots at different positions equals one-by-one decode."""

from __future__ import annotations

import pytest
import torch

from hetmoe.engine.executor.graphs import graph_sizes

FOLLOW = [17, 230, 5, 99]  # tokens fed after each prompt, one per decode step


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_batched_decode_equals_single_sequences(family: str, llm_of) -> None:
    runner = llm_of(family).runner
    prompts = [list(range(10, 15)), list(range(40, 51)), list(range(100, 117))]  # 5, 11, 17
    single = []
    for prompt in prompts:
        slot = runner.cache.allocate()
        steps = [runner.prefill(slot, prompt)]
        steps += [runner.decode([slot], [t])[0] for t in FOLLOW]
        single.append(torch.stack(steps))  # [1 + steps, V]
        runner.cache.free(slot)

    slots = [runner.cache.allocate() for _ in prompts]
    firsts = [runner.prefill(s, p) for s, p in zip(slots, prompts, strict=True)]
    batched = [torch.stack(firsts)]
    for token in FOLLOW:
        batched.append(runner.decode(slots[::-1], [token] * 3).flip(0))  # order must not matter
    assert [runner.lengths[s] for s in slots] == [len(p) + len(FOLLOW) for p in prompts]
    for slot in slots:
        runner.cache.free(slot)
    together = torch.stack(batched, dim=1)  # [B, 1 + steps, V]
    for b in range(len(prompts)):
        torch.testing.assert_close(together[b], single[b], rtol=0, atol=2e-5)
        assert torch.equal(together[b].argmax(-1), single[b].argmax(-1))


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_decode_logits_equal_prefill_logits(family: str, llm_of) -> None:
    """Decode steps (MLA: attention in latent space) give the logits a prefill gives."""
    runner = llm_of(family).runner
    ids = list(range(60, 90))
    slot = runner.cache.allocate()
    try:
        whole = runner.prefill_logits(slot, ids)  # [30, V]
        runner.prefill(slot, ids[:20])
        steps = torch.stack([runner.decode([slot], [t])[0] for t in ids[20:]])  # [10, V]
    finally:
        runner.cache.free(slot)
    torch.testing.assert_close(steps, whole[20:], rtol=0, atol=1e-4)


def test_prefill_can_extend_a_slot(llm_of) -> None:
    runner = llm_of("mixtral").runner
    ids = list(range(20, 44))
    slot = runner.cache.allocate()
    whole = runner.prefill_logits(slot, ids)  # [24, V]
    runner.prefill(slot, ids[:10])
    tail = runner.prefill_logits(slot, ids[10:], start=10)
    runner.cache.free(slot)
    torch.testing.assert_close(tail, whole[10:], rtol=0, atol=2e-5)


def test_runner_errors_are_explicit(llm_of) -> None:
    runner = llm_of("qwen3_moe").runner
    slot = runner.cache.allocate()
    try:
        with pytest.raises(ValueError, match=f"slot {slot} holds 0 tokens; decode needs 1 to"):
            runner.decode([slot], [5])
        with pytest.raises(ValueError, match=r"KV-cache slot 99 out of range \[0, 8\)"):
            runner.prefill(99, [5])
        with pytest.raises(ValueError, match=r"token ids \[512\] out of the vocabulary \[0, 512\)"):
            runner.prefill(slot, [5, 512])
        with pytest.raises(ValueError, match="prefill needs at least one token"):
            runner.prefill(slot, [])
        with pytest.raises(ValueError, match="prefill start 3 is beyond slot .* 0 cached tokens"):
            runner.prefill(slot, [5], start=3)
        window = runner.max_seq_len
        with pytest.raises(ValueError, match=f"{window + 1} tokens do not fit the context window "
                                             f"of {window}"):
            runner.prefill(slot, [5] * (window + 1))
        runner.prefill(slot, [5] * 3)
        with pytest.raises(ValueError, match=r"a step got a slot twice: \[.*\]"):
            runner.decode([slot, slot], [5, 6])
        with pytest.raises(ValueError,
                           match="a decode step needs one token per slot, got 1 slots and 2"):
            runner.decode([slot], [5, 6])
    finally:
        runner.cache.free(slot)
    with pytest.raises(RuntimeError, match=f"KV-cache slot {slot} is freed twice"):
        runner.cache.free(slot)


def test_full_context_window_stops_decode(llm_of) -> None:
    runner = llm_of("qwen2_moe").runner
    slot = runner.cache.allocate()
    try:
        runner.prefill(slot, [7] * (runner.max_seq_len - 1))
        runner.decode([slot], [8])  # fills the last position
        with pytest.raises(ValueError, match=f"context window is full at {runner.max_seq_len}"):
            runner.decode([slot], [9])
    finally:
        runner.cache.free(slot)


def test_greedy_steps_are_the_argmax_decode_loop_and_end_at_the_window(llm_of) -> None:
    runner = llm_of("qwen3_moe").runner
    slot = runner.cache.allocate()
    try:
        first = int(runner.prefill(slot, [3, 4, 5]).argmax())
        want, token = [], first
        for _ in range(4):
            token = int(runner.decode([slot], [token])[0].argmax())
            want.append(token)
        runner.cache.free(slot)
        slot = runner.cache.allocate()
        runner.prefill(slot, [3, 4, 5])
        steps = runner.greedy(slot, first)
        assert [next(steps) for _ in range(4)] == want
        steps.close()
        assert runner.lengths[slot] == 3 + 4
        runner.cache.free(slot)
        slot = runner.cache.allocate()
        runner.prefill(slot, [3, 4, 5])
        assert list(runner.greedy(slot, first, limit=3)) == want[:3]  # then it ends
        assert runner.lengths[slot] == 3 + 3
        runner.cache.free(slot)
        slot = runner.cache.allocate()
        runner.prefill(slot, [7] * (runner.max_seq_len - 2))
        assert len(list(runner.greedy(slot, 8))) == 2  # then the window is full
        assert runner.lengths[slot] == runner.max_seq_len
    finally:
        runner.cache.free(slot)


def test_graph_sizes_double_up_to_max_batch() -> None:
    assert graph_sizes((1, 2, 4, 8), 8) == (1, 2, 4, 8)
    assert graph_sizes((1, 2, 4, 8), 4) == (1, 2, 4, 8)
    assert graph_sizes((1, 2, 4, 8), 64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_sizes((1, 2, 4, 8), 48) == (1, 2, 4, 8, 16, 32, 48)
    assert graph_sizes((3,), 10) == (3, 6, 10)
