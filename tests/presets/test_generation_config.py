"""Presets ship a generation_config.json whose sampling the server takes for fields a request
leaves out: the demo's is SmolLM2-Instruct's recommended sampling, the tiny presets' greedy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hetmoe import LLM
from hetmoe.engine.model.model_setup import sampling_defaults
from hetmoe.presets import presets, resolve_model
from hetmoe.presets.demo import write_generation_config
from hetmoe.server.sampling import request_sampling

SMOLLM2_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _defaults_of_a_request(model: dict, **given: float) -> tuple[float, float]:
    params = request_sampling(model, 8, temperature=given.get("temperature"),
                              top_p=given.get("top_p"), top_k=None)
    return params.temperature, params.top_p


def test_demo_like_checkpoint_samples_as_the_model_card_says(tiny_qwen3_moe: Path,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "demo-like"
    shutil.copytree(tiny_qwen3_moe, path)
    (path / "generation_config.json").unlink(missing_ok=True)
    write_generation_config(path, SMOLLM2_TOKENS)
    written = json.loads((path / "generation_config.json").read_text())
    assert (written["do_sample"], written["temperature"], written["top_p"]) == (True, 0.2, 0.9)
    llm = LLM(path, device="cpu", experts="torch", progress=False, max_seq_len=64)
    assert llm.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert _defaults_of_a_request(llm.sampling_defaults) == (0.2, 0.9)
    assert _defaults_of_a_request(llm.sampling_defaults, temperature=0.0, top_p=1.0) == (0.0, 1.0)
    assert _defaults_of_a_request({}) == (1.0, 1.0)  # no file: OpenAI's defaults


def test_demo_presets_are_rebuilt_with_the_file() -> None:
    """Version 1 caches were built without the file."""
    assert all(presets()[name].version >= 2 for name in ("demo", "demo-sparse"))


def test_tiny_presets_answer_greedily_by_default(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny-mixtral")
    assert path.name == "tiny-mixtral-v2"  # caches built before the file are not reused
    assert sampling_defaults(path) == {"temperature": 0.0}
    assert _defaults_of_a_request(sampling_defaults(path)) == (0.0, 1.0)
