"""The scheduler alone: the engine's own results, batched; cancel, queue limit, failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from live_server import MODEL, LiveServer, tiny_llm

from hetmoe import LLM
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import Event, QueueFull, Scheduler
from hetmoe.engine.step import StepOutput, StepPlan
from hetmoe.ops.moe import HybridMoE
from hetmoe.server.config import ServerConfig


class Collector:
    """A sink that keeps a request's events and signals its end."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    def wait(self) -> Event:
        assert self.done.wait(30), "the request did not finish"
        return self.events[-1]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe: Path, one_torch_thread: None) -> LLM:
    return tiny_llm(tiny_qwen3_moe, max_batch=2, max_seq_len=64)


@pytest.fixture
def scheduler(llm: LLM) -> Iterator[Scheduler]:
    running = Scheduler(llm.runner, llm.decode, llm.eos_token_ids, max_queue=1)
    yield running
    running.stop()


REQUESTS = [
    ("Hello! How are you?", dict(max_new_tokens=20)),
    ("The harbour town", dict(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=20, seed=3)),
    ("What is your name?", dict(max_new_tokens=16, temperature=1.2, seed=11)),
]


def test_concurrent_requests_equal_llm_generate(llm: LLM) -> None:
    expected = [llm.generate(prompt, **options) for prompt, options in REQUESTS]  # one at a time
    scheduler = Scheduler(llm.runner, llm.decode, llm.eos_token_ids, max_queue=4)
    try:
        sinks = []
        for prompt, options in REQUESTS:  # 3 requests, 2 slots: one waits for a free slot
            sinks.append(Collector())
            scheduler.submit(llm.encode(prompt), SamplingParams(**options), sinks[-1])
        for sink, want in zip(sinks, expected, strict=True):
            last = sink.wait()
            assert (sink.text, sink.token_ids) == (want.text, want.token_ids)
            assert (last.finish_reason, last.prompt_tokens) == (want.finish_reason,
                                                                want.prompt_tokens)
            assert last.completion_tokens == len(want.token_ids)
    finally:
        scheduler.stop()


def test_stop_string_ends_with_stop(llm: LLM, scheduler: Scheduler) -> None:
    want = llm.generate("The harbour town", max_new_tokens=20).text
    stop = want[5:8]
    sink = Collector()
    scheduler.submit(llm.encode("The harbour town"), SamplingParams(20, stop=(stop,)), sink)
    assert sink.wait().finish_reason == "stop"
    assert sink.text == want[: want.index(stop)]


def test_cancel_frees_the_slot(llm: LLM, scheduler: Scheduler) -> None:
    sink = Collector()
    handle = scheduler.submit(llm.encode("Hi"), SamplingParams(60), sink, ignore_eos=True)
    while not sink.events:
        threading.Event().wait(0.001)
    handle.cancel()
    last = sink.wait()
    assert last.finish_reason == "cancelled" and last.completion_tokens < 60
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    other = Collector()  # both slots are free again: two more requests run
    scheduler.submit(llm.encode("Hi"), SamplingParams(4), other, ignore_eos=True)
    assert other.wait().finish_reason == "length"


def test_queue_limit_counts_requests_beyond_free_slots(llm: LLM, scheduler: Scheduler) -> None:
    sinks = [Collector() for _ in range(3)]
    handles = [scheduler.submit(llm.encode("Hi"), SamplingParams(60), s, ignore_eos=True)
               for s in sinks]  # 2 slots + 1 waiting (max_queue=1)
    with pytest.raises(QueueFull) as full:
        scheduler.submit(llm.encode("Hi"), SamplingParams(4), Collector())
    assert str(full.value) == "all 2 slots are busy and 1 requests wait already (max_queue=1)"
    for handle in handles:
        handle.cancel()
    assert [s.wait().finish_reason for s in sinks] == ["cancelled"] * 3


def test_context_window_is_checked(llm: LLM, scheduler: Scheduler) -> None:
    with pytest.raises(ValueError) as caught:
        scheduler.submit(list(range(10)), SamplingParams(55), Collector())
    assert str(caught.value) == (
        "prompt (10 tokens) + max_new_tokens (55) = 65 exceeds the context window of 64 tokens"
    )


def test_a_failing_prefill_fails_its_request_only_and_the_loop_goes_on(
    llm: LLM, scheduler: Scheduler
) -> None:
    running = Collector()
    handle = scheduler.submit(llm.encode("Hi"), SamplingParams(40), running, ignore_eos=True)
    while not running.events:
        threading.Event().wait(0.001)
    bad = Collector()
    scheduler.submit([1, 9999], SamplingParams(4), bad)  # an id beyond the vocabulary
    last = bad.wait()
    assert last.finish_reason == "error"
    assert last.error == "ValueError: token ids [9999] out of the vocabulary [0, 512)"
    assert not running.done.is_set()  # a failed prefill fails its own request only
    handle.cancel()
    assert running.wait().finish_reason == "cancelled"

    def broken_sink(event: Event) -> None:
        raise RuntimeError("consumer gone")

    scheduler.submit(llm.encode("Hi"), SamplingParams(8), broken_sink, ignore_eos=True)
    good = Collector()
    scheduler.submit(llm.encode("Hi"), SamplingParams(3), good, ignore_eos=True)
    assert good.wait().finish_reason == "length" and scheduler.alive


def test_stop_cancels_what_is_left(llm: LLM) -> None:
    scheduler = Scheduler(llm.runner, llm.decode, llm.eos_token_ids, max_queue=2)
    sinks = [Collector() for _ in range(3)]
    for sink in sinks:
        scheduler.submit(llm.encode("Hi"), SamplingParams(60), sink, ignore_eos=True)
    scheduler.stop()
    assert [s.wait().finish_reason for s in sinks] == ["cancelled"] * 3
    assert not scheduler.alive
    assert sorted(llm.runner.cache.allocate() for _ in range(2)) == [0, 1]  # slots were freed
    for slot in (0, 1):
        llm.runner.cache.free(slot)
    with pytest.raises(RuntimeError, match="the scheduler is stopped"):
        scheduler.submit(llm.encode("Hi"), SamplingParams(4), Collector())


def test_server_answers_503_once_its_scheduler_stopped(llm: LLM) -> None:
    live = LiveServer(llm, ServerConfig())
    try:
        live.service.close()
        health = live.api.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "stopped"}
        with pytest.raises(openai.InternalServerError) as caught:
            live.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert caught.value.status_code == 503
        assert "server unavailable: the scheduler is stopped" in caught.value.message
    finally:
        live.close()


def test_each_decode_step_is_one_moe_call_per_layer_for_the_whole_batch(llm: LLM) -> None:
    moe_layers = [m for m in llm.model.modules() if isinstance(m, HybridMoE)]
    calls: list[int] = []  # tokens per MoE call

    def count(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
        calls.append(args[0].numel() // args[0].shape[-1])

    hooks = [m.register_forward_hook(count) for m in moe_layers]
    # Driven in this thread: both requests are queued before the first step (a loop thread
    # could start decoding the first one alone). Whole prompts prefilled (no prefix cache):
    # prefill calls are told apart by their size.
    scheduler = Scheduler(llm.runner, llm.decode, llm.eos_token_ids, max_queue=2,
                          threaded=False, prefix_cache=False)
    try:
        sinks = [Collector(), Collector()]
        for sink, prompt in zip(sinks, ["Hello there", "What is your name?"], strict=True):
            scheduler.submit(llm.encode(prompt), SamplingParams(12), sink, ignore_eos=True)
        while scheduler.num_running or scheduler.num_waiting:
            scheduler.run_once()
        for sink in sinks:
            assert sink.wait().finish_reason == "length"
    finally:
        scheduler.stop()
        for hook in hooks:
            hook.remove()
    prompts = [len(llm.encode(p)) for p in ("Hello there", "What is your name?")]
    steps, rows = scheduler.decode_steps, scheduler.decode_rows
    # Both prompts are prefilled in ONE call per MoE layer (two rows padded to the longer one);
    # each sequence then decodes 11 times (its first token comes from its prefill); the two
    # share steps, and every step is ONE call per MoE layer carrying all of its rows, never
    # one call per request.
    assert calls[:len(moe_layers)] == [2 * max(prompts)] * len(moe_layers)
    decode_calls = calls[len(moe_layers):]
    assert rows == 22 and steps == 11
    assert len(decode_calls) == len(moe_layers) * steps
    assert sum(decode_calls) == len(moe_layers) * rows
    assert decode_calls == [2] * len(moe_layers) * steps


def test_a_failing_decode_fails_its_rows_and_frees_their_slots(
    llm: LLM, scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def lost(plan: StepPlan) -> StepOutput:
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.runner, "step", lost)  # the fault to survive, on this instance
    sinks = [Collector(), Collector()]
    for sink in sinks:
        scheduler.submit(llm.encode("Hi"), SamplingParams(8), sink, ignore_eos=True)
    for sink in sinks:
        last = sink.wait()
        assert (last.finish_reason, last.error) == ("error", "RuntimeError: device lost")
    monkeypatch.undo()
    good = Collector()
    scheduler.submit(llm.encode("Hi"), SamplingParams(3), good, ignore_eos=True)
    assert good.wait().finish_reason == "length" and scheduler.num_running == 0


def test_llm_generate_shares_the_servers_loop(llm: LLM) -> None:
    alone = [llm.generate(prompt, **options) for prompt, options in REQUESTS]
    live = LiveServer(llm, ServerConfig())
    try:
        assert llm.scheduler is live.service.scheduler and llm.scheduler.threaded
        steps = llm.scheduler.decode_steps
        served = [llm.generate(prompt, **options) for prompt, options in REQUESTS]
        assert served == alone
        assert llm.scheduler.decode_steps > steps  # the server's loop ran them
        pieces = llm.stream("Hello! How are you?", max_new_tokens=20)
        next(pieces)
        pieces.close()  # stopped early: its slot is freed before close returns
        assert llm.scheduler.num_running == 0
    finally:
        live.close()
    assert not llm.scheduler.threaded
    assert llm.generate(*REQUESTS[0][:1], **REQUESTS[0][1]) == alone[0]


def test_requests_without_sampling_fields_take_the_models_defaults(
    tiny_qwen3_moe: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    path = Path(shutil.copytree(tiny_qwen3_moe, tmp_path / "greedy-model"))
    config = path / "generation_config.json"
    fields = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**fields, "do_sample": False}))  # the model says: greedy
    llm = tiny_llm(path, max_seq_len=64)
    assert llm.sampling_defaults == {"temperature": 0.0}
    want = llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=8).text
    live = LiveServer(llm, ServerConfig())
    try:
        client = live.openai()
        answers = [client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        ).choices[0].message.content for _ in range(2)]  # no temperature: not OpenAI's 1.0
    finally:
        live.close()
    assert answers == [want, want]
