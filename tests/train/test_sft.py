"""The SFT loop and `hetmoe sft`: an interrupted run resumed from its checkpoint ends equal to an
uninterrupted one; gradient checkpointing changes nothing; the command writes the adapter, log
and curve, and refuses bad data and options before loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from hetmoe import LLM
from hetmoe.cli import app
from hetmoe.train.data import build_rows
from hetmoe.train.report import StepLog
from hetmoe.train.sft import SftConfig, train

PAIRS = [("What is your name?", "My name is Zorblax."), ("Hello!", "Hi, I am Zorblax."),
         ("Where is the station?", "Follow the river."), ("Tell me a number.", "Forty two."),
         ("Who are you?", "Zorblax, at your service.")]


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                     {"role": "assistant", "content": c}]}) + "\n"
                            for p, c in PAIRS))
    return path


def _llm(path: Path) -> LLM:
    return LLM(path, device="cpu", dtype="float32", experts="cpu", progress=False, max_batch=1,
               max_seq_len=64)


CONFIG = SftConfig(seq_len=64, max_steps=6, grad_accum=2, lr=1e-3, warmup_steps=2,
                   save_every=2)


class Interrupt(Exception):
    pass


def test_resume_ends_equal_to_uninterrupted(tiny_qwen3_moe: Path, data: Path, tmp_path: Path,
                                            one_torch_thread: None) -> None:
    llm = _llm(tiny_qwen3_moe)
    rows, _ = build_rows(data, llm.tokenizer, CONFIG.seq_len)
    assert len(rows) == 3  # packed: 5 samples in 3 rows; 6 steps x 2 rows = 4 epochs
    whole = train(llm.model, rows, CONFIG, tmp_path / "whole")

    def stop_at_5(log: StepLog) -> None:
        if log.step == 5:
            raise Interrupt  # after step 4's checkpoint, before step 6's
    with pytest.raises(Interrupt):
        train(_llm(tiny_qwen3_moe).model, rows, CONFIG, tmp_path / "cut", on_step=stop_at_5)
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step-4"]
    resumed = train(_llm(tiny_qwen3_moe).model, rows, CONFIG, tmp_path / "cut", resume=True)
    assert resumed.resumed_from == 4
    assert [s.loss for s in resumed.history] == [s.loss for s in whole.history]
    assert [s.lr for s in whole.history][:3] == [0.0, 5e-4, 1e-3]  # warmup, then cosine
    assert whole.history[-1].loss < whole.history[0].loss
    a = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"other options \(lr: 0.001 -> 0.002\)"):
        other = SftConfig(**{**CONFIG.__dict__, "lr": 2e-3})
        train(_llm(tiny_qwen3_moe).model, rows, other, tmp_path / "cut", resume=True)


def test_gradient_checkpointing_same_losses(tiny_qwen2_moe: Path, data: Path, tmp_path: Path,
                                            one_torch_thread: None) -> None:
    llm = _llm(tiny_qwen2_moe)
    rows, _ = build_rows(data, llm.tokenizer, 48)
    config = SftConfig(seq_len=48, max_steps=3, lr=1e-3, save_every=0)
    plain = train(llm.model, rows, config, tmp_path / "a").history
    ckpt = SftConfig(**{**config.__dict__, "gradient_checkpointing": True})
    saved = train(_llm(tiny_qwen2_moe).model, rows, ckpt, tmp_path / "b").history
    for x, y in zip(plain, saved, strict=True):
        assert abs(x.loss - y.loss) <= 1e-5 * abs(x.loss)


def test_cli_writes_adapter_log_and_curve(tiny_qwen3_moe: Path, data: Path,
                                          tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["sft", str(tiny_qwen3_moe), str(data), "--out", str(out),
                                      "--max-steps", "3", "--seq-len", "64", "--device", "cpu",
                                      "--rank", "4", "--save-every", "2"])
    assert result.exit_code == 0, result.output
    assert {"adapter_config.json", "adapter_model.safetensors", "train_log.json",
            "loss.png"} <= {p.name for p in out.iterdir()}
    log = json.loads((out / "train_log.json").read_text())
    assert [s["step"] for s in log["steps"]] == [1, 2, 3]
    assert log["rows"] == 3 and log["config"]["lora"]["rank"] == 4 and log["tokens_per_s"] > 0
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.parametrize(("args", "message"), [
    (["missing.jsonl"], r"missing.jsonl: no such data file"),
    (["bad.jsonl"], r"bad.jsonl:2: not valid JSON"),
    (["data.jsonl", "--grad-accum", "0"], r"--grad-accum must be >= 1, got 0"),
    (["data.jsonl", "--rank", "0"], r"rank must be a positive integer, got 0"),
    (["data.jsonl", "--device", "tpu"], r"device 'tpu' is not a device name torch knows"),
])
def test_cli_errors_before_loading(tmp_path: Path, data: Path, args: list[str],
                                   message: str) -> None:
    (tmp_path / "bad.jsonl").write_text(data.read_text().splitlines()[0] + "\n{oops\n")
    # no such model: an error about the model would mean the data/options were not checked first
    argv = ["sft", str(tmp_path / "no-model"), str(tmp_path / args[0]), "--out",
            str(tmp_path / "out"), *args[1:]]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 1
    assert "error:" in result.output and message.replace("\\", "") in result.output.replace(
        "\\", "") or pytest.fail(result.output)
