"""Our engine on `demo` against the dense SmolLM2 in unmodified transformers: the
routed-expert path must give the dense model's logits (fp32) and its greedy text."""

from __future__ import annotations

import pytest
from smollm2 import QUESTION, assert_same_as_dense, assert_same_greedy_as_dense, fp32_llm
from typer.testing import CliRunner

from hetmoe.cli import app
from hetmoe.engine.engine import LLM
from hetmoe.presets import presets

GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def demo_llm(demo_dir) -> LLM:
    return fp32_llm(demo_dir)


def test_logits_match_dense_smollm2(demo_llm, dense):
    assert_same_as_dense(demo_llm, dense)


def test_greedy_text_equals_dense_smollm2(demo_llm, dense):
    assert_same_greedy_as_dense(demo_llm, dense, GREEDY_TOKENS)


def test_demo_answers_paris(demo_llm):
    answer = demo_llm.chat(QUESTION, max_new_tokens=16)
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop"


def test_cli_chat_with_the_preset_name(demo_dir, tmp_path, monkeypatch):
    # The preset name resolves to a cached build: put this session's build where the cache is.
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path))
    preset = presets()["demo"]
    cached = tmp_path / "models" / f"demo-v{preset.version}"
    cached.mkdir(parents=True)
    for file in demo_dir.iterdir():
        (cached / file.name).symlink_to(file)
    (cached / ".complete").write_text("demo\n")
    result = CliRunner().invoke(
        app, ["chat", "demo", "--max-new-tokens", "16"], input="What is the capital of France?\n"
    )
    assert result.exit_code == 0, result.output
    assert "The capital of France is Paris." in result.output
