"""Decode steps of many rows through the prefill planner (`EngineConfig.stream_decode_rows`): a
step's experts streamed to the "GPU" (the CPU device here: the streamer runs the same copies and
compute in order) or split with the CPU gives the decode path's greedy tokens and its logits
within the format's tolerance; small steps never ask the planner; in "auto" mode the decode
tuner weighs the decode path against the streamed pass and keeps the faster, each step timed as
served: the decode path's turns launched ahead (CUDA graphs stood in for)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_overlap import FakeSteps

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import TRIES, SplitCosts
from hetmoe.engine.placement.slots import expert_bytes
from hetmoe.engine.step import StepPlan
from hetmoe.inject.rules import shipped_rules_path
from hetmoe.presets.tiny import FAMILIES

PROMPTS = [list(range(5 + 7 * i, 15 + 7 * i)) for i in range(6)]
"""Six 10-token prompts, decoded together: steps of 6 rows."""
STEPS = 4
STREAM_ATOL = 0.05
"""|Δlogits| of bf16 experts streamed against the CPU's (tests/engine/test_stream_placement.py:
the same products summed in another order; seen here: at most 0.004)."""
FORMAT_RTOL = {"int8": 0.03, "int4": 0.03}
"""|Δlogits| / max |logit| of int experts: the CPU's int kernels quantize each row's
activations, the streamed experts dequantize the weights alone (seen: at most 0.022 of the
baby models' logits of ~12, on qwen3_moe); a pair lost or counted twice moves them by more."""
EVEN = SplitCosts(cpu_fixed=1e-6, cpu_token=1e-7, gpu_expert=2e-6)
"""Costs of equal CPU and GPU work per expert: splits near the middle."""


@pytest.fixture(scope="module")
def llm_with(tiny_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str, str], LLM]:
    """`llm_with(family, format)`: a cached fp32 CPU `LLM` whose routed experts are `cpu` in
    that packed format."""
    built: dict[tuple[str, str], LLM] = {}

    def get(family: str, fmt: str) -> LLM:
        if (family, fmt) not in built:
            rules = tmp_path_factory.mktemp("rules") / f"{family}_{fmt}.yaml"
            rules.write_text(Path(shipped_rules_path(family)).read_text().replace(
                "kwargs: {experts: auto}", f"kwargs: {{experts: cpu, weight_format: {fmt}}}"))
            built[family, fmt] = LLM(tiny_dir(family), device="cpu", dtype="float32",
                                     rules=rules, progress=False, max_seq_len=64)
        return built[family, fmt]

    return get


def _runner(llm: LLM, rows: int, mode: str = "gpu", budget: int = 0,
            costs: SplitCosts | None = None) -> ModelRunner:
    """A runner over `llm`'s model whose planner can stream on the CPU device (a planner of
    a GPU run: its refusal check passes), `rows` its `stream_decode_rows`."""
    config = EngineConfig(stream_decode_rows=rows, prefill_experts=mode, gpu_expert_bytes=budget)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, len(PROMPTS), 64, config)
    overlap = runner.overlap
    assert overlap is not None
    planner = PrefillPlanner(overlap.cpu[0].num_experts, overlap.top_k, len(overlap.cpu), costs,
                             refusal=lambda: "")
    planner.overlap = overlap
    planner.place(runner.placement)
    planner.prepare(mode, 0, rows, runner.max_batch)
    runner.planner = planner
    return runner


@contextmanager
def _streamed_ks(runner: ModelRunner) -> Iterator[list[tuple[int, int]]]:
    """(tokens, k) of every pass the overlap streams while open."""
    overlap = runner.overlap
    assert overlap is not None
    seen: list[tuple[int, int]] = []
    original = overlap.streamed

    @contextmanager
    def streamed(tokens: int, k: int | None = None) -> Iterator[None]:
        seen.append((tokens, -1 if k is None else k))
        with original(tokens, k):
            yield

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(overlap, "streamed", streamed)
        yield seen


def _decode(runner: ModelRunner, feed: list[list[int]] | None = None
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """PROMPTS prefilled, then STEPS decode steps of all rows: (tokens per row, [B, V] logits
    per step); `feed`: each row's inputs (teacher forcing), else each step's argmax."""
    try:
        slots = [runner.cache.allocate() for _ in PROMPTS]
        tokens = [[int(runner.prefill(s, p).argmax())] for s, p in zip(slots, PROMPTS,
                                                                        strict=True)]
        tokens = feed or tokens
        logits = []
        for step in range(STEPS):
            out = runner.decode(slots, [t[step] for t in tokens])  # [B, V]
            logits.append(out)
            if feed is None:
                for row, t in zip(out.argmax(-1).tolist(), tokens, strict=True):
                    t.append(row)
        return tokens, logits
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()


def _max_delta(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, ref, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_decode_steps_give_the_decode_paths_tokens(
        llm_with: Callable[[str, str], LLM], family: str) -> None:
    llm = llm_with(family, "bf16")
    ref_tokens, ref = _decode(_runner(llm, 0))
    runner = _runner(llm, 4)
    assert runner.planner is not None and runner.planner.decode_rows == 4
    with _streamed_ks(runner) as seen:
        tokens, logits = _decode(runner)
    experts = runner.planner.num_experts
    # Each prompt's prefill streams (mode "gpu" in both runners), then each 6-row step.
    assert seen == [(10, experts)] * len(PROMPTS) + [(6, experts)] * STEPS
    assert tokens == ref_tokens
    delta = _max_delta(logits, ref)
    assert delta <= STREAM_ATOL, f"{family}: |Δlogits| {delta:.3g}"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_int_experts_streamed_in_decode_are_within_the_formats_tolerance(
        llm_with: Callable[[str, str], LLM], family: str, fmt: str) -> None:
    llm = llm_with(family, fmt)
    ref_tokens, ref = _decode(_runner(llm, 0))
    runner = _runner(llm, 6)
    with _streamed_ks(runner) as seen:
        _, logits = _decode(runner, ref_tokens)  # the same inputs: near ties may flip
    assert seen[len(PROMPTS):] == [(6, runner.planner.num_experts)] * STEPS  # type: ignore[union-attr]
    scale = max(r.abs().max().item() for r in ref)
    delta = _max_delta(logits, ref)
    assert delta <= FORMAT_RTOL[fmt] * scale, f"{family} {fmt}: |Δlogits| {delta:.3g}"


def test_a_split_decode_step_with_resident_experts_equals_the_decode_path(
        llm_with: Callable[[str, str], LLM]) -> None:
    llm = llm_with("qwen3_moe", "bf16")
    plain = _runner(llm, 0)
    assert plain.overlap is not None
    per_expert = sum(expert_bytes(plain.overlap.cpu))  # one expert of every layer
    ref_tokens, ref = _decode(plain)
    runner = _runner(llm, 6, "split", 3 * per_expert, EVEN)  # 3 of 8 experts resident
    planner, overlap = runner.planner, runner.overlap
    assert planner is not None and overlap is not None and runner.placement is not None
    k, timed = planner.decode_experts(6, "split")
    assert 1 <= k < 5 and not timed  # a split of the 5 misses, no tuner in "split" mode
    with _streamed_ks(runner) as seen:
        tokens, logits = _decode(runner)
    assert seen[len(PROMPTS):] == [(6, k)] * STEPS
    assert overlap.streamer is not None and overlap.streamer.copied_bytes == k * per_expert
    assert tokens == ref_tokens
    assert _max_delta(logits, ref) <= STREAM_ATOL


def test_steps_below_the_rows_keep_the_decode_path_and_never_ask_the_planner(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = llm_with("qwen3_moe", "bf16")
    ref_tokens, ref = _decode(_runner(llm, 0))
    runner = _runner(llm, 7)  # one row more than the steps have
    assert runner.planner is not None

    def asked(rows: int, mode: str = "auto") -> tuple[int, bool]:
        raise AssertionError(f"the planner was asked about a decode step of {rows} rows")

    monkeypatch.setattr(runner.planner, "decode_experts", asked)
    with _streamed_ks(runner) as seen:
        tokens, logits = _decode(runner)
    assert all(tokens_ == 10 for tokens_, _ in seen)  # the prompts' passes alone
    assert tokens == ref_tokens and torch.equal(torch.stack(logits), torch.stack(ref))


def test_auto_weighs_the_decode_path_against_the_stream_and_keeps_the_faster(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    llm = llm_with("qwen3_moe", "bf16")
    ref_tokens, _ = _decode(_runner(llm, 0, "cpu"))
    runner = _runner(llm, 6, "auto", costs=EVEN)
    planner = runner.planner
    assert planner is not None
    options = planner.decode_tuner.options(6, planner.top_k, planner.num_experts, EVEN)
    assert options[0] == 0 and len(options) >= 2  # the decode path, then streamed ks
    steps = TRIES * len(options) + 2
    try:
        slots = [runner.cache.allocate() for _ in PROMPTS]
        tokens = [[int(runner.prefill(s, p).argmax())] for s, p in zip(slots, PROMPTS,
                                                                        strict=True)]
        syncs.clear()
        with _streamed_ks(runner) as seen:
            for _ in range(steps):
                out = runner.decode(slots, [t[-1] for t in tokens])
                for row, t in zip(out.argmax(-1).tolist(), tokens, strict=True):
                    t.append(row)
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()
    assert [t[:STEPS + 1] for t in tokens] == ref_tokens
    measured = planner.decode_tuner.measured[planner.decode_tuner.bucket(6)]
    assert {k: len(t) for k, t in measured.items()} == dict.fromkeys(options, TRIES)
    assert syncs == []  # timed from one step's start to the next's: no GPU sync
    best = min(options, key=lambda k: min(measured[k]))
    streamed = [k for _, k in seen]
    assert streamed == [k for k in options * TRIES if k] + [best] * 2 * bool(best)


def test_a_weighed_decode_path_turn_is_launched_ahead_and_its_second_step_timed(
        llm_with: Callable[[str, str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(llm_with("qwen3_moe", "bf16"), 6, "auto", costs=EVEN)
    planner = runner.planner
    assert planner is not None
    fake = FakeSteps(runner)
    runner.use_graphs = True  # the greedy steps' scheduling, without a GPU
    monkeypatch.setattr(runner, "_launch", fake.launch)
    monkeypatch.setattr(runner, "_read", fake.read)
    asked: list[int] = []
    decode_experts = planner.decode_experts

    def counted(rows: int, mode: str = "auto") -> tuple[int, bool]:
        asked.append(rows)
        return decode_experts(rows, mode)

    monkeypatch.setattr(planner, "decode_experts", counted)
    # The prompts' prefill on the CPU, untimed (a weighed prefill pass syncs the GPU): this test
    # weighs decode steps.
    monkeypatch.setattr(planner.tuner, "pick", lambda *args, **kwargs: (0, False))
    options = planner.decode_tuner.options(6, planner.top_k, planner.num_experts, EVEN)
    try:
        slots = tuple(runner.cache.allocate() for _ in PROMPTS)
        tokens = tuple(int(runner.prefill(s, p).argmax()) for s, p in zip(slots, PROMPTS,
                                                                           strict=True))
        weighing = TRIES * (len(options) + 1)  # the decode path's turns are two steps
        for _ in range(weighing):
            out = runner.step(StepPlan(slots, tokens, greedy=True, ahead=True)).tokens
            assert out is not None
            tokens = out
        # Each decode-path turn launches its second step ahead, as served; that one launches
        # nothing (the planner is asked next) and is the one timed. Streamed ks ran between.
        assert fake.events == [e for n in range(0, 2 * TRIES, 2) for e in
                               (f"launch {n}", f"launch {n + 1}", f"read {n}", f"read {n + 1}")]
        assert asked == [6] * TRIES * len(options)
        # The step after the last weighed one records its time, then asks. The stand-in decode
        # path is far faster than a real pass: settled on it, its steps launch the next one
        # ahead, and a continued step asks the planner nothing.
        asked.clear()
        fake.events.clear()
        for _ in range(3):
            out = runner.step(StepPlan(slots, tokens, greedy=True, ahead=True)).tokens
            assert out is not None
            tokens = out
        n = 2 * TRIES
        assert fake.events == [f"launch {n}", f"launch {n + 1}", f"read {n}", f"launch {n + 2}",
                               f"read {n + 1}", f"launch {n + 3}", f"read {n + 2}"]
        assert asked == [6]  # the first step alone; the others continued the one ahead
        measured = planner.decode_tuner.measured[planner.decode_tuner.bucket(6)]
        assert {k: len(t) for k, t in measured.items()} == dict.fromkeys(options, TRIES)
        assert planner.decode_experts(6) == (0, False)
        runner.settle()  # the step launched ahead, never read: rolled back
        assert all(runner.lengths[s] == 10 + weighing + 3 for s in slots)
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()
