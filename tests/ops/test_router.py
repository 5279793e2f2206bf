"""Our router against each family's HF router module on the same weights and inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetmoe.ops.router import Router, RouterConfig, route
from hetmoe.presets.tiny import FAMILIES, tiny_config

_HF_ROUTERS = {
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter",
    "deepseek_v2": "transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
    "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
}


def hf_router(family: str, config: object) -> nn.Module:
    import importlib

    module, name = _HF_ROUTERS[family].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(config)


def by_expert(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id, so unsorted (DeepSeek) and sorted top-k compare."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_equals_hf(family: str, dtype: torch.dtype) -> None:
    config = tiny_config(family)
    gen = torch.Generator().manual_seed(0)
    ref = hf_router(family, config)
    ours = Router(RouterConfig.from_hf(config), config.hidden_size)
    weight = torch.randn(ref.weight.shape, generator=gen)
    ref.weight.data = weight.to(dtype)
    ours.weight = nn.Parameter(weight.to(dtype))
    if family == "deepseek_v3":
        bias = torch.randn(config.n_routed_experts, generator=gen)  # large: it must steer
        ref.e_score_correction_bias = bias
        ours.e_score_correction_bias = bias
    x = torch.randn(64, config.hidden_size, generator=gen).to(dtype)  # [T, H]
    _, ref_weights, ref_ids = ref(x)
    ids, weights = ours(x)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    ref_ids, ref_weights = by_expert(ref_ids, ref_weights)
    ids, weights = by_expert(ids, weights)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


def test_v3_bias_and_groups_change_the_choice() -> None:
    """Guards the test above: on its inputs, plain top-k of the scores picks other experts."""
    config = tiny_config("deepseek_v3")
    gen = torch.Generator().manual_seed(0)
    ours = Router(RouterConfig.from_hf(config), config.hidden_size)
    ours.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size,
                                           generator=gen))
    ours.e_score_correction_bias = torch.randn(config.n_routed_experts, generator=gen)
    x = torch.randn(64, config.hidden_size, generator=gen)
    ids, _ = ours(x)
    plain = torch.topk((x @ ours.weight.T).sigmoid(), config.num_experts_per_tok).indices
    assert not torch.equal(ids.sort().values, plain.sort().values)


def test_deepseek_v3_defaults_without_config_json_keys() -> None:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)
    assert not hasattr(config, "scoring_func")
    router = RouterConfig.from_hf(config)
    assert (router.scoring, router.topk_method, router.has_bias) == ("sigmoid", "noaux_tc", True)
    assert router.scale_when_normalized and router.logits_fp32


def test_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match="topk_method must be one of .* got 'best'"):
        RouterConfig(8, 2, topk_method="best")
    with pytest.raises(ValueError, match="scoring_func must be one of .* got 'relu'"):
        RouterConfig(8, 2, scoring="relu")
    with pytest.raises(ValueError, match="n_group=3 must divide 8 experts"):
        RouterConfig(8, 2, topk_method="noaux_tc", num_groups=3)
    with pytest.raises(ValueError, match=r"^topk_group=3 must be between 1 and n_group=2 for "
                       r"topk_method 'noaux_tc'$"):
        RouterConfig(8, 2, topk_method="noaux_tc", num_groups=2, topk_groups=3)
    with pytest.raises(ValueError, match="topk_group=0 must be between 1 and n_group=1"):
        RouterConfig(8, 2, topk_method="group_limited_greedy", topk_groups=0)


@pytest.mark.parametrize(("method", "groups", "kept", "limited"), [
    ("greedy", 1, 1, False), ("greedy", 4, 2, False),  # greedy ignores groups, as HF
    ("noaux_tc", 1, 1, False), ("noaux_tc", 4, 4, False), ("group_limited_greedy", 4, 4, False),
    ("noaux_tc", 4, 2, True), ("group_limited_greedy", 4, 1, True),
])
def test_groups_limit_the_choice_only_when_fewer_are_kept(method: str, groups: int, kept: int,
                                                           limited: bool) -> None:
    """`limits_groups` is `route`'s own test: a router it calls unlimited routes as its plain
    top-k of the (biased) scores, whatever its groups."""
    c = RouterConfig(16, 3, scoring="sigmoid", topk_method=method, num_groups=groups,
                     topk_groups=kept)
    assert c.limits_groups is limited and c.kernel_fits() is not limited
    gen = torch.Generator().manual_seed(groups + kept)
    x, weight = torch.randn(64, 32, generator=gen), torch.randn(16, 32, generator=gen)
    bias = torch.randn(16, generator=gen) if c.has_bias else None
    ids, weights = route(x, weight, bias, c)
    scores = (x @ weight.T).sigmoid()
    plain = torch.topk(scores if bias is None else scores + bias, 3, dim=-1).indices
    assert torch.equal(ids, plain) is not limited
    assert torch.equal(weights, scores.gather(1, ids))  # the bias steers the choice only
