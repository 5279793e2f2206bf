"""What loading reads and checks before any slow work: the checkpoint's sampling defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmoe.engine.model.model_setup import sampling_defaults


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_sampling_defaults_follow_generation_config(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}  # no file: no opinion
    qwen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}
    assert sampling_defaults(write(tmp_path, json.dumps(qwen))) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    greedy = {"do_sample": False, "temperature": 0.7}
    assert sampling_defaults(write(tmp_path, json.dumps(greedy))) == {"temperature": 0.0}


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not valid JSON"),
    ('{"temperature": "hot"}', "field 'temperature' must be a number, got 'hot'"),
])
def test_a_bad_generation_config_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=f"{path / 'generation_config.json'}: {message}"):
        sampling_defaults(path)
