"""Our engine on the demo checkpoints against the dense SmolLM2 in unmodified transformers: the
routed-expert path must give the dense model's logits (fp32) and its greedy text."""

from __future__ import annotations

import shutil

import pytest
from baby import assert_logits_close, reference_logits
from smollm2 import QUESTION, STORY, chat_ids, greedy_until_eos
from typer.testing import CliRunner

from hetmoe.cli import app
from hetmoe.engine.engine import LLM
from hetmoe.presets import presets

GREEDY_TOKENS = 24


def _fp32_llm(path) -> LLM:
    return LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)


@pytest.fixture(scope="module")
def demo_llm(demo_dir) -> LLM:
    return _fp32_llm(demo_dir)


@pytest.fixture(scope="module")
def demo_sparse_llm(demo_sparse_dir) -> LLM:
    return _fp32_llm(demo_sparse_dir)


@pytest.mark.parametrize("variant", ["demo_llm", "demo_sparse_llm"])
def test_logits_match_dense_smollm2(variant, dense, request):
    llm = request.getfixturevalue(variant)
    ids = chat_ids(llm.path, QUESTION)
    assert_logits_close(llm.logits(ids), reference_logits(dense, ids), atol=1e-3)


@pytest.mark.parametrize("variant", ["demo_llm", "demo_sparse_llm"])
def test_greedy_text_equals_dense_smollm2(variant, dense, request):
    llm = request.getfixturevalue(variant)
    ids = chat_ids(llm.path, STORY)
    ours = llm.generate(ids, max_new_tokens=GREEDY_TOKENS)
    ref = greedy_until_eos(dense, ids, GREEDY_TOKENS, eos=2)
    assert ours.token_ids == ref, f"ours {llm.decode(ours.token_ids)!r}, dense {llm.decode(ref)!r}"
    assert len(ours.token_ids) == GREEDY_TOKENS  # a real continuation, not an early stop


def test_demo_answers_paris(demo_llm):
    answer = demo_llm.chat(QUESTION, max_new_tokens=16)
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop"


def test_cli_chat_with_the_preset_name(demo_dir, tmp_path, monkeypatch):
    # The preset name resolves to a cached build: put this session's build where the cache is.
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path))
    preset = presets()["demo"]
    cached = tmp_path / "models" / f"demo-v{preset.version}"
    shutil.copytree(demo_dir, cached)
    (cached / ".complete").write_text("demo\n")
    result = CliRunner().invoke(
        app, ["chat", "demo", "--max-new-tokens", "16"], input="What is the capital of France?\n"
    )
    assert result.exit_code == 0, result.output
    assert "The capital of France is Paris." in result.output
