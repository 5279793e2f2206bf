"""LLM: generation loop, stopping, sampling seeds, streaming, chat, and user errors."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from hetmoe import LLM, GenerationOutput
from hetmoe.engine.model.kv_fit import MAX_AUTO_SLOTS, planned_memory
from hetmoe.inject.rules import RULES_DIR, RuleError
from hetmoe.loading.memory_plan import kv_bytes_per_token

PROMPT = "Hello! The harbour town woke slowly that morning."


def test_stream_pieces_make_the_generated_text(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    out = llm.generate(PROMPT, max_new_tokens=24)
    assert isinstance(out, GenerationOutput)
    assert out.prompt_tokens == len(llm.encode(PROMPT))
    assert "".join(llm.stream(PROMPT, max_new_tokens=24)) == out.text
    assert llm.generate(llm.encode(PROMPT), max_new_tokens=24) == out  # ids or text alike


def test_stop_string_cuts_the_text(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    full = llm.generate(PROMPT, max_new_tokens=24)
    assert full.finish_reason == "length" and len(full.text) > 12
    stop = full.text[8:11]
    cut = llm.generate(PROMPT, max_new_tokens=24, stop=[stop, "never-seen"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert "".join(llm.stream(PROMPT, max_new_tokens=24, stop=stop)) == cut.text


def test_eos_ends_generation(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    # Make EOS every step's argmax through the model's own head: its lm_head row dominant.
    head = llm.model.lm_head.weight
    saved = head.data.clone()
    eos = min(llm.eos_token_ids)
    head.data[eos] = head.data[eos] * 0 + head.data.abs().max() * 50
    try:
        out = llm.generate(PROMPT, max_new_tokens=10)
    finally:
        head.data.copy_(saved)
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    slots = [llm.runner.cache.allocate() for _ in range(llm.runner.max_batch)]  # all were freed
    for slot in slots:
        llm.runner.cache.free(slot)


def test_seeded_sampling_is_reproducible(llm_of) -> None:
    llm = llm_of("mixtral")
    a = llm.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_k=50, seed=7)
    b = llm.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_k=50, seed=7)
    c = llm.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_k=50, seed=8)
    assert a == b
    assert a.token_ids != c.token_ids


def test_context_window_limits_generation(tiny_dir) -> None:
    llm = LLM(tiny_dir("qwen2_moe"), device="cpu", dtype="float32", max_seq_len=24,
              progress=False)
    prompt = list(range(20, 40))  # 20 tokens
    out = llm.generate(prompt, max_new_tokens=100)
    # 4 more positions fit; the token sampled from the last one needs no cache entry.
    assert (len(out.token_ids), out.finish_reason) == (5, "length")
    with pytest.raises(ValueError, match="the prompt has 25 tokens but the context window is "
                                         "24 tokens"):
        llm.generate(list(range(20, 45)))
    with pytest.raises(ValueError, match=r"the prompt is empty \(0 tokens\)"):
        llm.logits([])
    assert llm.runner.cache.allocate() == 0  # failed calls took no slot


def test_logits_shape_and_chat_template(llm_of) -> None:
    llm = llm_of("deepseek_v2")
    ids = llm.encode(PROMPT)
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), 512) and logits.dtype.is_floating_point
    messages = [{"role": "user", "content": "What is your name?"}]
    prompt = llm.chat_prompt(messages)
    assert llm.tokenizer.decode(prompt) == "<s><|user|>\nWhat is your name?</s>\n<|assistant|>\n"
    assert llm.chat(messages, max_new_tokens=8) == llm.generate(prompt, max_new_tokens=8)
    assert "".join(llm.stream_chat(messages, max_new_tokens=8)) == llm.chat(
        messages, max_new_tokens=8).text


def test_bad_arguments_are_named(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    with pytest.raises(ValueError, match="top_p must be in"):
        llm.generate(PROMPT, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        llm.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"token ids \[9999\] out of the vocabulary"):
        llm.generate([1, 9999])
    with pytest.raises(TypeError, match="unknown LLM option.* max_tokens; known: "):
        LLM("tiny-qwen3-moe", max_tokens=3)
    with pytest.raises(ValueError, match=r"unknown expert backend 'gpu9' \(known: .*torch\)"):
        LLM("tiny-qwen3-moe", experts="gpu9")
    with pytest.raises(ValueError, match="option dtype must be one of auto, float32, bfloat16"):
        LLM("tiny-qwen3-moe", dtype="int3")


def test_deferral_option_is_checked(tiny_dir) -> None:
    with pytest.raises(ValueError, match=r"option deferred must be 'auto' or an integer >= 0, "
                                         r"got -1"):
        LLM(tiny_dir("qwen3_moe"), device="cpu", deferred=-1, progress=False)
    # Deferral overlaps CPU experts with GPU attention: a CPU-only run refuses it, never ignores.
    with pytest.raises(ValueError, match=r"option deferred=2 needs GPU decode .* decodes on cpu "
                                         r"\(use deferred=0\)"):
        LLM(tiny_dir("qwen3_moe"), device="cpu", experts="cpu", deferred=2, progress=False)


def test_missing_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda:0' requested but no CUDA GPU is available"):
        LLM("tiny-qwen3-moe", device="cuda:0")


def test_unsupported_model_type(tiny_dir, tmp_path: Path) -> None:
    path = tmp_path / "llama"
    shutil.copytree(tiny_dir("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuleError, match="no shipped rules for model_type 'llama' "
                                        r"\(families with rules: deepseek_v2, deepseek_v3, "
                                        r"mixtral, qwen2_moe, qwen3_moe\)"):
        LLM(path, device="cpu", progress=False)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):  # the loader's
        LLM(path, device="cpu", progress=False, rules=RULES_DIR / "qwen3_moe.yaml")


def test_a_list_of_prompts_is_generated_together(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    prompts = ["The quick brown fox", "Once upon a time", "Hello"]
    alone = [llm.generate(p, max_new_tokens=6) for p in prompts]
    steps = llm.scheduler.decode_steps
    together = llm.generate(prompts, max_tokens=6)  # the OpenAI name of max_new_tokens
    assert together == alone
    assert llm.scheduler.decode_steps - steps <= 6  # one batched step per token, not per prompt
    ids = [llm.encode(p) for p in prompts[:2]]
    assert llm.generate(ids, max_new_tokens=6) == alone[:2]  # lists of token ids too
    assert llm(prompts[2], max_new_tokens=6) == alone[2]  # calling the LLM generates


def test_generate_arguments_are_checked(llm_of) -> None:
    llm = llm_of("qwen3_moe")
    with pytest.raises(ValueError, match="give max_new_tokens or max_tokens, not both"):
        llm.generate("Hi", max_new_tokens=3, max_tokens=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(["Hi", []])
    assert llm.scheduler.num_running == llm.scheduler.num_waiting == 0  # nothing was submitted


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", "device 'tpu' is not a device name torch knows; use cpu, cuda or cuda:N"),
    ("meta", "device 'meta': hetmoe runs on cpu or cuda"),
])
def test_unusable_devices_are_refused_before_loading(device: str, message: str,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path / "no-model-here", device=device)  # refused before the path is read


def auto_llm(path: Path) -> LLM:
    return LLM(path, device="cpu", dtype="float32", experts="torch", max_seq_len=64,
               max_batch="auto", progress=False)


def test_max_batch_auto_is_the_slots_that_fit_at_most_256(tiny_dir, caplog,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_dir("qwen3_moe")
    fit = auto_llm(path).kv_fit  # this host has room for far more than 256 slots of 64 tokens
    assert fit is not None
    assert (fit.slots, fit.limit) == (MAX_AUTO_SLOTS, "the cap of 256 (max_batch N for more)")
    # On the CPU device the KV cache lives in host memory: MemAvailable less the weights and a
    # margin (1 GiB: 5 % of this MemAvailable is less), in slots of max_seq_len tokens.
    mem, config = planned_memory(path, torch.device("cpu"), torch.float32, None, "torch", None)
    slot = 64 * kv_bytes_per_token(config, torch.float32)
    free = mem.total("host") + 2**30 + 3 * slot + slot // 2
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available", lambda: free)
    with caplog.at_level(logging.INFO, logger="hetmoe.engine.engine"):
        llm = auto_llm(path)
    fit = llm.kv_fit
    assert fit is not None and llm.runner.max_batch == llm.max_batch == fit.slots == 3
    assert llm.options.max_batch == "auto"  # the option as given; the count is the runner's
    assert fit.limit.startswith("the most that fit the 0.00 GiB the host has for KV (")
    assert [r.getMessage() for r in caplog.records] == [
        f"KV slots: 3 (auto: {(3 * slot + slot // 2) / 2**30:.2f} GiB free for KV on the host, "
        f"{slot / 2**20:.2f} MiB per slot of 64 tokens; slots: {fit.limit})"]
    prompts = ["The quick brown fox", "Once upon a time", "Hello", "Tea", "A B C"]
    alone = [llm.generate(p, max_new_tokens=6) for p in prompts]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hetmoe.engine.engine"):
        assert llm.generate(prompts, max_new_tokens=6) == alone  # 3 at a time, the rest queued
    assert [r.getMessage() for r in caplog.records] == [
        '5 prompts, 3 KV slots (max_batch): 3 decode together, the rest as slots free; '
        'max_batch="auto" sizes the slots from the memory the weights leave']
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available",
                        lambda: mem.total("host") + 2**30 + slot - 1)
    with pytest.raises(ValueError, match=rf"not even one KV slot fits: one slot of 64 tokens "
                                         rf"takes {slot} bytes .*; lower max_seq_len, or free "
                                         "memory"):
        auto_llm(path)


@pytest.mark.parametrize("bad", ["foo", "Auto", 0, -2, 2.5, True, None])
def test_bad_max_batch_is_named_before_loading(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"option max_batch must be 'auto' or a positive "
                                         rf"integer, got {bad!r}"):
        LLM(tmp_path / "no-model-here", max_batch=bad)  # refused before the path is read


def test_on_the_cpu_device_an_expert_budget_takes_host_memory_from_auto_slots(
        tiny_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_dir("qwen3_moe")
    mem, config = planned_memory(path, torch.device("cpu"), torch.float32, None, "cpu", None)
    budget = sum(n * size for n, size in mem.expert_layers)  # every expert resident
    slot = 64 * kv_bytes_per_token(config, torch.float32)
    free = mem.total("host") + 2**30 + budget + 2 * slot + slot // 2
    monkeypatch.setattr("hetmoe.loading.memory_plan.host_available", lambda: free)
    llm = LLM(path, device="cpu", dtype="float32", experts="cpu", max_seq_len=64,
              max_batch="auto", gpu_expert_bytes=budget, progress=False)
    # No GPU, yet the budget's resident copies are made, in host memory beside the packed
    # experts: the KV room is the host's less that budget (kv_fit.kv_room).
    placement = llm.runner.placement
    assert placement is not None and placement.plan.bytes == budget
    packed = [t for layer in placement.layers for t in layer.packed]
    assert {t.device.type for t in packed} == {"cpu"} and sum(t.numel() for t in packed) == budget
    fit = llm.kv_fit
    assert fit is not None and (fit.room.bytes, llm.max_batch) == (2 * slot + slot // 2, 2)
    assert fit.room.parts[-1] == ("--gpu-expert-gib", budget)
