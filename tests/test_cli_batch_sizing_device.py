"""`hetmoe batch`'s KV sizing on a GPU (`pytest -m device` on a GPU host): the cache on the GPU,
the model loaded with the chosen slots and window, the room read from the GPU's free memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from hetmoe.cli import app
from hetmoe.cli_batch_sizing import size_job
from hetmoe.cli_engine import EngineOptions
from hetmoe.engine.requests.batch_job import JobLine

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

MODEL = "tiny-qwen3-moe"
GIB = 2**30


def chat(i: int, tokens: int) -> dict[str, Any]:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": tokens,
                     "messages": [{"role": "user", "content": f"Question {i}"}]}}


def test_the_kv_cache_of_a_job_lives_on_the_gpu_and_the_model_gets_its_size(
    tmp_path: Path
) -> None:
    from hetmoe import LLM

    lines = [chat(i, 8 + i) for i in range(12)]
    todo = [JobLine(i + 1, x["custom_id"], x["url"], x["body"]) for i, x in enumerate(lines)]
    engine = EngineOptions(device="cuda", experts="cpu")
    sizing = size_job(MODEL, todo, engine, None, None, progress=False)
    fit = sizing.fit
    assert (fit.room.place, fit.room.device) == ("GPU", "cuda")
    assert (fit.slots, fit.window, fit.limit) == (12, 256, "the job's 12 sequences")
    assert fit.room.bytes > fit.kv_bytes
    llm = LLM(MODEL, device="cuda", experts="cpu", max_batch=fit.slots, max_seq_len=fit.window,
              progress=False)
    assert (llm.runner.max_batch, llm.max_seq_len) == (12, 256)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["batch", str(source), str(out), "--device", "cuda",
                                      "--experts", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "batch KV cache: 12 slots x 256 tokens = " in result.output
    assert " on the GPU (cuda); slots: the job's 12 sequences" in result.output
    assert len(out.read_text().splitlines()) == 12


def test_a_gpu_without_room_for_one_slot_is_refused_naming_its_bytes(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    todo = [JobLine(1, "r0", "/v1/chat/completions", chat(0, 8)["body"])]
    with pytest.raises(ValueError) as error:
        size_job(MODEL, todo, EngineOptions(device="cuda", experts="cpu"), None, None, False)
    message = str(error.value)
    assert message.startswith("not even one KV slot fits: one slot of 256 tokens takes ")
    assert f"the GPU (cuda) has 0 bytes for the KV cache ({GIB} bytes free, less " in message
    assert f" of CUDA graphs, {4 * GIB} of margin); lower --max-seq-len" in message
