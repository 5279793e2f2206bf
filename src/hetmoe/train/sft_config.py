"""The options of one SFT run (train/sft.py), apart from the loop: the CLI reads its defaults
without importing torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hetmoe.train.lora import LoraSettings


@dataclass(frozen=True)
class SftConfig:
    """Options of one SFT run (the CLI takes its defaults from here)."""

    seq_len: int = 1024
    """Tokens per packed row (one forward)."""
    epochs: int = 1
    """Passes over the data, unless max_steps is set."""
    max_steps: int | None = None
    """Optimizer steps (overrides epochs; the data repeats as needed)."""
    grad_accum: int = 1
    """Packed rows per optimizer step."""
    lr: float = 2e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warmup steps before the cosine decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    seed: int = 0
    """Seed of the adapter's initialization and the data order."""
    save_every: int = 50
    """Steps between resumable checkpoints (0 = none)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """What the adapter adapts."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "epochs", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        for name in ("warmup_steps", "save_every", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")

    def total_steps(self, num_rows: int) -> int:
        """Optimizer steps of the run over `num_rows` packed rows."""
        if self.max_steps is not None:
            return self.max_steps
        return math.ceil(self.epochs * num_rows / self.grad_accum)

    def record(self) -> dict[str, Any]:
        """The options as plain values (saved in checkpoints and the log)."""
        out = asdict(self)
        out["lora"] = {k: list(v) if isinstance(v, tuple) else v for k, v in out["lora"].items()}
        return out
