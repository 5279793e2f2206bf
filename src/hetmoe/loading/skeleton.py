"""The HF model skeleton on the `meta` device: every module and shape, no weight memory."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM


def build_skeleton(config: Any, dtype: torch.dtype) -> nn.Module:
    """`AutoModelForCausalLM` of `config` on `meta`, parameters and buffers in `dtype`.

    Tensors the HF class keeps in float32 (`_keep_in_fp32_modules_strict` for fp16/bf16,
    `_keep_in_fp32_modules` for fp16; e.g. DeepSeek-V3's `e_score_correction_bias`) stay float32,
    as `from_pretrained` does. Nothing is allocated: materialization gives each tensor its memory.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16) and keep:
        _upcast(model, keep)
    return model


def _upcast(model: nn.Module, patterns: set[str]) -> None:
    """Makes the floating tensors whose qualified name contains a pattern float32."""
    pattern = re.compile("|".join(re.escape(p) for p in sorted(patterns)))
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                qualified = f"{module_name}.{name}" if module_name else name
                if tensor is None or not tensor.is_floating_point():
                    continue
                if not pattern.search(qualified):
                    continue
                upcast = tensor.to(torch.float32)
                is_param = isinstance(tensor, nn.Parameter)
                table[name] = nn.Parameter(upcast, tensor.requires_grad) if is_param else upcast
