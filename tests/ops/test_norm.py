"""ops/norm.py: HF's RMSNorm modules of every family run as `fused.rms_norm`, bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch

from hetmoe.ops.norm import apply_norm, eps_of, norm_weight

NORMS = [("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"),
         ("mixtral", "MixtralRMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
         ("deepseek_v3", "DeepseekV3RMSNorm")]


@pytest.mark.parametrize(("family", "name"), NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_norm_equals_each_familys_hf_rms_norm(family: str, name: str,
                                                    dtype: torch.dtype) -> None:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, name)(48, eps=1e-5).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = (torch.randn(2, 3, 48, generator=g) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(apply_norm(norm, x), norm(x))
    assert eps_of(norm) == 1e-5


def test_a_layer_norm_is_refused_by_name() -> None:
    norm = torch.nn.LayerNorm(8)  # a weight and an `eps`, but another formula
    with pytest.raises(ValueError, match=r"the decoder layer needs RMSNorms with a weight, "
                                         r"found LayerNorm\(\(8,\), eps=1e-05"):
        norm_weight(norm)


def test_a_norm_without_epsilon_is_refused() -> None:
    class NoEpsRMSNorm(torch.nn.Module):
        weight = torch.ones(4)

    with pytest.raises(ValueError, match=r"the decoder layer needs RMSNorms with an epsilon, "
                                         r"found NoEpsRMSNorm\(\)"):
        eps_of(NoEpsRMSNorm())
