"""The decoder layer's RMSNorm modules run as `ops/fused.py` `rms_norm` over their weight.

Both paths call that one function: the fused decode step with the weights `LayerPlan` took
(engine/executor/layer_plan.py), the module path with the module here. HF's RMSNorm of every
supported family (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3; transformers 5.17 to 5.24) is
the same formula in the same ops (tests/ops/test_fused.py holds `rms_norm` to it), so calling
the weight instead of the module changes no number and adds no kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.ops.fused import rms_norm


def eps_of(norm: nn.Module | None) -> float:
    """An RMSNorm's epsilon (`variance_epsilon` in HF, `eps` in torch)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    if not isinstance(eps, float):
        raise ValueError(f"the decoder layer needs RMSNorms with an epsilon, found {norm!r}")
    return eps


def norm_weight(norm: nn.Module | None) -> torch.Tensor:
    """An RMSNorm's scale [D]; ValueError naming the module when it is not an RMSNorm (a
    LayerNorm also has a weight and an epsilon, but another formula)."""
    weight = getattr(norm, "weight", None)
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor):
        raise ValueError(f"the decoder layer needs RMSNorms with a weight, found {norm!r}")
    return weight


def apply_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for an HF RMSNorm module, as `rms_norm` of its weight and epsilon."""
    return rms_norm(x, norm_weight(norm), eps_of(norm))
