"""Resumable SFT checkpoints: `OUT/checkpoints/step-N/` holds the adapter (PEFT format) and
`trainer.pt` (optimizer, scheduler, step, RNG, log so far, the run's config and data
fingerprint). The data position is the step: step s trains micro-batches s*accum ... of one
seeded order (train/sft.py), so nothing else about the data needs saving."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from hetmoe.train.data import Row
from hetmoe.train.report import StepLog

STATE = "trainer.pt"


@dataclass
class TrainerState:
    """What a resumed run restores besides the adapter."""

    step: int
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: torch.Tensor
    history: list[StepLog]
    config: dict[str, Any]
    data: str


def fingerprint(rows: list[Row]) -> str:
    """A digest of the packed rows: a resumed run must train on the same data."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(repr((row.input_ids, row.labels, row.position_ids)).encode())
    return digest.hexdigest()[:16]


def checkpoints_dir(out: Path) -> Path:
    return out / "checkpoints"


def save_checkpoint(out: Path, peft_model: Any, state: TrainerState) -> Path:
    """Writes step-N (as step-N.tmp, renamed when complete, so a crash leaves no half
    checkpoint); older checkpoints are removed."""
    root = checkpoints_dir(out)
    final = root / f"step-{state.step}"
    tmp = root / f"step-{state.step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    torch.save({"step": state.step, "optimizer": state.optimizer, "scheduler": state.scheduler,
                "rng": state.rng, "history": [vars(s) for s in state.history],
                "config": state.config, "data": state.data}, tmp / STATE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in root.glob("step-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint under OUT, or None."""
    found = [p for p in checkpoints_dir(out).glob("step-*")
             if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE).is_file()]
    return max(found, key=lambda p: int(p.name.split("-")[1]), default=None)


def load_checkpoint(path: Path, peft_model: Any, config: dict[str, Any],
                    data: str) -> TrainerState:
    """Loads the adapter weights of checkpoint `path` into `peft_model` and returns its state;
    ValueError when the run's options or data differ from the checkpoint's."""
    raw = torch.load(path / STATE, weights_only=False)
    changed = sorted(k for k in set(config) | set(raw["config"])
                     if config.get(k) != raw["config"].get(k))
    if changed:
        pairs = ", ".join(f"{k}: {raw['config'].get(k)!r} -> {config.get(k)!r}" for k in changed)
        raise ValueError(f"--resume: {path} was trained with other options ({pairs}); rerun "
                         "with the same options or write to a new --out")
    if raw["data"] != data:
        raise ValueError(f"--resume: the data differs from {path}'s (another file or "
                         "tokenizer); rerun with the same data or write to a new --out")
    weights = load_file(str(path / "adapter_model.safetensors"))
    result: Any = set_peft_model_state_dict(peft_model, weights)
    if result.unexpected_keys:
        raise ValueError(f"--resume: {path} holds adapter weights this model lacks: "
                         f"{result.unexpected_keys[:3]}")
    return TrainerState(raw["step"], raw["optimizer"], raw["scheduler"], raw["rng"],
                        [StepLog(**s) for s in raw["history"]], raw["config"], raw["data"])
