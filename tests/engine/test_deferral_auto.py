"""`deferred="auto"`: the timing rule, the KL guard, the probe's measurements on a runner, the
choice made at load (never inside a request) and kept for `hetmoe info`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.cli import app
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.model import deferral_auto
from hetmoe.engine.model.deferral_auto import (
    KL_THRESHOLD,
    NO_GPU,
    DeferralChoice,
    StepTimes,
    choose_deferred,
    guarded,
    record_deferral,
    recorded_deferral,
    timed_count,
)
from hetmoe.engine.model.deferral_probe import KLProbe, step_seconds, without_cpu_experts
from hetmoe.ops.deferral import MIN_IMMEDIATE

PROMPT = [5, 9, 33, 100, 7, 12, 40, 3]


def times(gpu_layer_ms: float, cpu_expert_ms: float, top_k: int = 8,
          layers: int = 4) -> StepTimes:
    """Step times of `layers` MoE layers with these per-layer / per-expert costs."""
    gpu = gpu_layer_ms * 1e-3 * layers
    return StepTimes(gpu + cpu_expert_ms * 1e-3 * layers * top_k, gpu, layers, top_k)


def test_timing_rule_defers_the_fewest_that_fill_the_gpu_time() -> None:
    t = times(1.0, 0.4)
    assert t.gpu_layer_s == pytest.approx(1e-3) and t.cpu_expert_s == pytest.approx(4e-4)
    assert timed_count(t) == 3  # ceil(1.0 / 0.4): 2 experts leave 0.2 ms idle
    assert timed_count(times(0.8, 0.4)) == 2  # exactly filled
    assert timed_count(times(0.01, 0.4)) == 1
    assert timed_count(StepTimes(0.5, 0.5, 4, 8)) == 0  # CPU experts cost nothing measurable
    assert timed_count(StepTimes(1.0, 0.96, 4, 8)) == 0  # 4 % of a step: noise, not work
    assert timed_count(StepTimes(1.0, 0.94, 4, 8)) == 6  # 6 %: the GPU time dwarfs it, the cap


def test_timing_rule_in_the_misses_order_counts_only_the_cpu_experts() -> None:
    """With a quarter of a token's experts on the CPU, the measured CPU time is theirs: a
    deferred miss moves four times the per-expert average, so fewer fill the GPU's time; the
    score order defers a CPU expert only a quarter of the time and keeps the average."""
    t = times(1.0, 0.4)  # 0.4 ms per expert averaged over all K
    misses = dataclasses.replace(t, cpu_share=0.25)  # the default order
    assert misses.cpu_expert_s == pytest.approx(1.6e-3)
    assert timed_count(misses) == 1  # ceil(1.0 / 1.6)
    assert timed_count(dataclasses.replace(t, cpu_share=0.25, order="score")) == 3  # the average
    assert t.order == "misses"  # no placement: the score order's count
    assert timed_count(t) == timed_count(dataclasses.replace(t, order="score")) == 3
    assert timed_count(dataclasses.replace(t, cpu_share=0.0)) == 3  # no division by 0


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 8, 12])
@pytest.mark.parametrize("gpu_ms", [0.01, 0.5, 3.0, 100.0])
def test_timing_rule_keeps_two_immediate(top_k: int, gpu_ms: float) -> None:
    count = timed_count(times(gpu_ms, 2.0, top_k))  # the CPU over MIN_CPU_SHARE of a step
    assert 0 <= count <= max(top_k - MIN_IMMEDIATE, 0)
    assert top_k <= MIN_IMMEDIATE or top_k - count >= MIN_IMMEDIATE
    if gpu_ms == 100.0:  # the CPU can never fill it: the cap
        assert count == max(top_k - MIN_IMMEDIATE, 0)


def test_guard_keeps_the_count_when_the_kl_is_small() -> None:
    asked: list[int] = []
    choice = guarded(times(1.0, 0.4), lambda d: asked.append(d) or 0.01)
    assert (choice.deferred, asked, choice.kl) == (3, [3], ((3, 0.01),))
    assert choice.reason == ("GPU 1 ms per MoE layer, CPU 0.4 ms per expert: 3 of top-8 fill "
                             "the CPU's idle time, 2 at least immediate; probe KL 0.01 at 3 "
                             f"nats <= {KL_THRESHOLD}")


def test_guard_lowers_the_count_until_the_kl_passes() -> None:
    kl = {3: 0.4, 2: 0.2, 1: 0.03}
    choice = guarded(times(1.0, 0.4), kl.__getitem__)
    assert choice.deferred == 1 and choice.kl == ((3, 0.4), (2, 0.2), (1, 0.03))
    assert choice.describe().startswith("deferred auto: 1 (GPU 1 ms per MoE layer")
    assert choice.describe().endswith(f"probe KL 0.4 at 3, 0.2 at 2, 0.03 at 1 nats <= "
                                      f"{KL_THRESHOLD})")


def test_guard_falls_back_to_exact_decode_when_it_trips() -> None:
    choice = guarded(times(1.0, 0.4), lambda d: 1.0)  # a forced KL over the threshold
    assert choice.deferred == 0
    assert choice.kl == ((3, 1.0), (2, 1.0), (1, 1.0))
    assert choice.reason.endswith(f"probe KL 1 at 3, 1 at 2, 1 at 1 nats > {KL_THRESHOLD}: "
                                  "exact decode")
    untouched = guarded(StepTimes(0.5, 0.5, 4, 8), lambda d: pytest.fail("probed"))
    assert untouched.deferred == 0 and untouched.kl == ()  # nothing to defer, nothing probed


def test_cpu_run_picks_zero_without_measuring(engine: Callable[[str, str], LLM]) -> None:
    llm = engine("qwen3_moe", "cpu")
    lengths = list(llm.runner.lengths)
    assert choose_deferred(llm.runner, PROMPT) == DeferralChoice(0, NO_GPU)
    assert list(llm.runner.lengths) == lengths  # nothing decoded


def test_llm_chooses_once_at_load_before_any_request(
        tiny_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[int], int]] = []

    def spy(runner: ModelRunner, prompt: list[int]) -> DeferralChoice:
        calls.append((list(prompt), sum(runner.lengths)))  # tokens in the KV cache: none yet
        return DeferralChoice(0, "forced")

    monkeypatch.setattr("hetmoe.engine.engine.choose_deferred", spy)
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
              deferred="auto", progress=False, max_seq_len=64)
    assert llm.deferral == DeferralChoice(0, "forced") and llm.options.deferred == "auto"
    assert len(calls) == 1 and calls[0][1] == 0
    assert calls[0][0] == deferral_auto.probe_ids(llm.tokenizer, llm.runner.vocab_size)
    llm.generate(PROMPT, max_new_tokens=3, temperature=0.0)
    assert len(calls) == 1  # never inside a request
    plain = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="cpu",
                deferred=0, progress=False, max_seq_len=64)
    assert plain.deferral is None and len(calls) == 1


def test_auto_on_the_cpu_device_is_zero_with_its_reason(tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", dtype="float32", experts="torch",
              deferred="auto", progress=False, max_seq_len=64)
    assert llm.deferral == DeferralChoice(0, NO_GPU)
    assert llm.deferral.describe() == f"deferred auto: 0 ({NO_GPU})"
    with pytest.raises(ValueError, match=r"ModelRunner takes a deferred count, not 'auto' "
                                         r"\(LLM picks it\)"):
        ModelRunner(llm.model, llm.device, llm.dtype, 1, 64, EngineConfig(deferred="auto"))
    with pytest.raises(ValueError, match=r"option deferred must be 'auto' or an integer >= 0, "
                                         r"got 'some'"):
        EngineConfig(deferred="some")
    with pytest.raises(ValueError, match=r"option deferred must be 'auto' or an integer >= 0, "
                                         r"got True"):
        EngineConfig(deferred=True)


@contextmanager
def side_runner(cpu: LLM, max_batch: int,
                config: EngineConfig | None = None) -> Iterator[ModelRunner]:
    """A second runner on `cpu`'s model (CPU experts), its MoE step detached after."""
    runner = ModelRunner(cpu.model, cpu.device, cpu.dtype, max_batch, cpu.max_seq_len,
                         config)
    try:
        yield runner
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()


def first(runner: ModelRunner) -> torch.Tensor:
    """The logits [V] after prefilling PROMPT into a fresh slot (freed after)."""
    slot = runner.cache.allocate()
    try:
        return runner.prefill(slot, PROMPT)
    finally:
        runner.free(slot)


def kl_by_hand(cpu: LLM, tokens: list[int], deferred: int) -> torch.Tensor:
    """Log-probabilities [steps, V] of teacher-forced decode of `tokens` after PROMPT on a
    runner built with `deferred` (the probe's reference)."""
    with side_runner(cpu, 1, EngineConfig(deferred=deferred)) as runner:
        runner.prefill(0, PROMPT)
        rows = [torch.log_softmax(runner.decode([0], [t])[0].double(), -1) for t in tokens]
    return torch.stack(rows)


def test_kl_probe_matches_a_hand_computation(engine: Callable[[str, str], LLM]) -> None:
    cpu = engine("qwen3_moe", "cpu")  # top-4: up to 2 deferred
    with side_runner(cpu, 2) as runner:
        probe = KLProbe(runner, PROMPT, 6)
        assert len(probe.tokens) == 6 and probe.tokens[0] == int(first(runner).argmax())
        exact = kl_by_hand(cpu, probe.tokens, 0)
        assert torch.allclose(probe.exact, exact, atol=1e-9)
        assert probe.kl(0) == pytest.approx(0.0, abs=1e-12)
        for d in (1, 2):
            late = kl_by_hand(cpu, probe.tokens, d)
            want = float((exact.exp() * (exact - late)).sum(-1).mean())
            assert want > 1e-3  # deferral moves the distributions: not vacuous
            assert probe.kl(d) == pytest.approx(want, rel=1e-6)
            assert runner.overlap is not None and runner.overlap.deferred == 0  # left exact
        assert sorted(runner.cache.free_slots) == [0, 1]
        with pytest.raises(ValueError, match=r"a 8-token probe and 60 decode steps exceed the "
                                             r"context window \(64 tokens\)"):
            KLProbe(runner, PROMPT, 60)


def test_step_times_with_and_without_cpu_experts(engine: Callable[[str, str], LLM]) -> None:
    cpu = engine("qwen3_moe", "cpu")
    with side_runner(cpu, 1) as runner:
        assert 0 < step_seconds(runner, PROMPT, 3) < 10
        exact = first(runner)
        with without_cpu_experts(runner):
            masked = first(runner)
        assert (masked - exact).abs().max() > 1e-3  # the routed experts were left out
        assert torch.equal(first(runner), exact)  # and are back
        with pytest.raises(ValueError, match=r"context window \(64 tokens\) has no room for 80 "
                                             r"timed decode steps after a 8-token probe"):
            step_seconds(runner, PROMPT, 80)


def test_choice_kept_for_hetmoe_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     tiny_dir: Callable[..., Path]) -> None:
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path / "cache"))
    model, device = tiny_dir("qwen3_moe"), torch.device("cpu")
    assert recorded_deferral(model, device) is None
    choice = guarded(times(1.0, 0.4), lambda d: 0.01)
    record_deferral(model, choice, device)
    line = recorded_deferral(model, device)
    assert line is not None and line.startswith(choice.describe() + " [chosen ")
    done = CliRunner().invoke(app, ["info", str(model), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert f"deferred auto: 0 ({NO_GPU})" in done.output  # no GPU: the record is not asked
    deferral_auto.record_path().write_text("not json")
    with pytest.raises(ValueError, match=r"deferral.json: not a readable deferral record"):
        recorded_deferral(model, device)
    record_deferral(model, choice, device)  # a side record: rewritten, never a refusal
    again = recorded_deferral(model, device)
    assert again is not None and again.startswith(choice.describe() + " [chosen ")


@pytest.mark.device
def test_auto_on_a_gpu_measures_and_sets_the_count(tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", experts="cpu", deferred="auto",
              progress=False, max_seq_len=128, gpu_expert_bytes=0)  # every expert on the CPU
    choice = llm.deferral
    assert choice is not None and choice.times is not None
    # both measured; on this tiny model the CPU experts take ~nothing, so the full step can
    # time below the GPU-only one (a device run: 0.291 vs 0.298 ms): no order is asserted
    assert choice.times.full_s > 0 and choice.times.gpu_s > 0
    assert 0 <= choice.deferred <= timed_count(choice.times) <= 4 - MIN_IMMEDIATE
    assert llm.runner.overlap is not None and llm.runner.overlap.deferred == choice.deferred
    assert all(kl >= 0 and math.isfinite(kl) for _, kl in choice.kl)
    if choice.deferred:
        assert choice.kl[-1] == (choice.deferred, pytest.approx(choice.kl[-1][1]))
        assert choice.kl[-1][1] <= KL_THRESHOLD
    assert llm.generate(PROMPT, max_new_tokens=4, temperature=0.0).token_ids


@pytest.mark.device
def test_auto_with_every_expert_resident_is_zero_without_timing(
        tiny_dir: Callable[..., Path]) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", experts="cpu", deferred="auto",
              progress=False, max_seq_len=128)  # the tiny experts all fit the GPU (auto budget)
    assert llm.runner.placement is not None and llm.runner.placement.everything
    assert llm.deferral == DeferralChoice(
        0, "every routed expert resident on the GPU: no CPU work to hide")
