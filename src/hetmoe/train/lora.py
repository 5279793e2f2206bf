"""LoRA adapters on a loaded hetmoe model with `peft`: the attention projections and shared
experts by default (routed experts stay frozen in the CPU backend), saved in PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`), so HF PEFT loads the adapter on the
original transformers model: injected modules keep the HF child names."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj")
"""Attention projections of the supported families (GQA and DeepSeek MLA)."""
SHARED = ("gate_proj", "up_proj", "down_proj")
"""Projections of a shared expert (DeepSeek `shared_experts`, Qwen2-MoE `shared_expert`)."""


def default_targets() -> str:
    """PEFT `target_modules` regex (full match): attention projections and shared experts."""
    attn = "|".join(ATTENTION)
    shared = "|".join(SHARED)
    return rf".*\.self_attn\.({attn})|.*\.mlp\.shared_experts?\.({shared})"


@dataclass(frozen=True)
class LoraSettings:
    """What the adapter adapts and how."""

    rank: int = 16
    """LoRA rank r."""
    alpha: int = 32
    """Scale numerator: the update is (alpha / r) B A."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: str | tuple[str, ...] | None = None
    """PEFT target_modules: a full-match regex or module name suffixes; None = `default_targets`."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSettings: rank must be a positive integer, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings: dropout must be in [0, 1), got {self.dropout!r}")

    def peft_config(self, **extra: Any) -> Any:
        """The `peft.LoraConfig` of these settings (extra: more LoraConfig fields)."""
        from peft import LoraConfig  # seconds to import; this module loads at `hetmoe --help`

        targets = self.target_modules if self.target_modules is not None else default_targets()
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(targets) if isinstance(targets, tuple) else targets,
                          task_type="CAUSAL_LM", **extra)


@contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around peft's wrapping of a model (`get_peft_model`, `PeftModel.from_pretrained`): peft
    (through 0.21) asks the model `is_gradient_checkpointing`, which transformers 5 deprecated
    for `is_activation_checkpointing`, so that FutureWarning is about peft's code, not ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        yield


def attach_lora(model: nn.Module, settings: LoraSettings, **extra: Any) -> Any:
    """Wraps `model` (a loaded hetmoe or transformers model) in a `peft.PeftModel` whose only
    trainable parameters are the adapters; ValueError when no module matches the targets."""
    from peft import get_peft_model  # as in peft_config

    try:
        with peft_wrapping():
            return get_peft_model(model, settings.peft_config(**extra))
    except ValueError as err:
        raise ValueError(f"attach_lora: target_modules {settings.target_modules!r} matched no "
                         f"module of {type(model).__name__} ({err})") from err


def save_adapter(peft_model: Any, out: str | Path) -> Path:
    """Writes the adapter in PEFT's format into directory `out`; returns it."""
    out = Path(out)
    peft_model.save_pretrained(str(out))
    return out
