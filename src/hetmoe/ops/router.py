"""MoE router with each family's exact semantics, translated once from the HF config.

- mixtral: softmax over logits in the model dtype, greedy top-k, weights renormalized.
- qwen2_moe / qwen3_moe: softmax, greedy, renormalized if `norm_topk_prob`, weights rounded to
  the model dtype (as HF does).
- deepseek_v2: fp32 logits, softmax, `greedy` or `group_limited_greedy` (groups ranked by their
  best expert); renormalized if `norm_topk_prob`, else scaled by `routed_scaling_factor`.
- deepseek_v3: fp32 logits, sigmoid, `noaux_tc`: `e_score_correction_bias` steers the choice only,
  groups ranked by the sum of their top-2; renormalized if `norm_topk_prob`, then scaled.

DeepSeek-V3's config.json may carry `scoring_func` / `topk_method`, which `DeepseekV3Config` does
not declare; they are honoured when present, with the defaults above otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RouterConfig:
    """How one family turns router logits into expert ids and weights."""

    num_experts: int
    """Routed experts (E)."""
    top_k: int
    """Experts per token (K)."""
    scoring: str = "softmax"
    """`softmax` or `sigmoid` of the logits."""
    topk_method: str = "greedy"
    """`greedy`, `group_limited_greedy` (DeepSeek-V2) or `noaux_tc` (DeepSeek-V3)."""
    num_groups: int = 1
    """Expert groups (`n_group`) for the group-limited methods."""
    topk_groups: int = 1
    """Groups a token may pick from (`topk_group`)."""
    norm_topk_prob: bool = False
    """Renormalize the K weights to sum to 1."""
    scaling_factor: float = 1.0
    """`routed_scaling_factor` applied to the weights."""
    scale_when_normalized: bool = True
    """False for DeepSeek-V2, which scales only when it does not normalize."""
    logits_fp32: bool = False
    """DeepSeek computes the router matmul in fp32."""
    round_weights: bool = False
    """Qwen rounds the weights to the activations' dtype before use."""

    @property
    def limits_groups(self) -> bool:
        """Whether expert groups limit the choice (`route`): a group-limited method with fewer
        groups to pick from than there are (else its choice is the plain top-k)."""
        return self.topk_method != "greedy" and self.topk_groups < self.num_groups

    def kernel_fits(self) -> bool:
        """Whether kernels/moe_router.py computes this router exactly: any whose choice no
        expert group limits (greedy; `noaux_tc` with its steering bias, e.g. one group)."""
        return not self.limits_groups

    def kernel_args(self) -> tuple[int, bool, bool, float, bool, bool]:
        """kernels/moe_router.py `moe_router`'s arguments from top_k on."""
        scaling = self.scaling_factor if self.scale_when_normalized or not self.norm_topk_prob \
            else 1.0
        return (self.top_k, self.scoring == "sigmoid", self.norm_topk_prob, scaling,
                self.logits_fp32, self.round_weights)

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func must be one of {SCORING}, got {self.scoring!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(
                f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}"
            )
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group={self.num_groups} must divide {self.num_experts} experts")
        if self.topk_method != "greedy" and not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be between 1 and "
                             f"n_group={self.num_groups} for topk_method {self.topk_method!r}")

    @property
    def has_bias(self) -> bool:
        """Whether the router owns `e_score_correction_bias`."""
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf(cls, config: Any) -> RouterConfig:
        """Translates a HF MoE config (the five supported families) into a RouterConfig."""
        kind = config.model_type
        if kind == "mixtral":
            return cls(config.num_local_experts, config.num_experts_per_tok, norm_topk_prob=True)
        if kind in ("qwen2_moe", "qwen3_moe"):
            return cls(config.num_experts, config.num_experts_per_tok,
                       norm_topk_prob=bool(config.norm_topk_prob), round_weights=True)
        if kind in ("deepseek_v2", "deepseek_v3"):
            v3 = kind == "deepseek_v3"
            scoring = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
            method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
            return cls(
                config.n_routed_experts,
                config.num_experts_per_tok,
                scoring=scoring,
                topk_method=method,
                num_groups=config.n_group or 1,
                topk_groups=config.topk_group or 1,
                norm_topk_prob=bool(config.norm_topk_prob),
                scaling_factor=float(config.routed_scaling_factor),
                scale_when_normalized=v3,
                logits_fp32=True,
            )
        raise ValueError(f"no router semantics for model_type {kind!r}")


class Router(nn.Module):
    """`forward(x [T, H]) -> (expert_ids [T, K] int64, expert_weights [T, K] float32)`."""

    e_score_correction_bias: torch.Tensor

    def __init__(
        self, config: RouterConfig, hidden_size: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        # Created on meta like the rest of the skeleton; the loader materializes them.
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, hidden_size, device="meta", dtype=dtype)
        )
        if config.has_bias:  # fp32, as real checkpoints store it
            self.register_buffer(
                "e_score_correction_bias", torch.empty(config.num_experts, device="meta")
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routes T tokens; see the module doc for the per-family semantics."""
        bias = self.e_score_correction_bias if self.config.has_bias else None
        return route(x, self.weight, bias, self.config)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          c: RouterConfig, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H] (bias [E] for `noaux_tc`) -> (ids [T, K] int64 sorted
    by score, weights [T, K] fp32): a pure function, so the fused decode step can compile it.

    `fused=True` (decode, few tokens) writes the logits as a product-sum and the top-k as K
    argmax passes, which a compiler fuses into two kernels (a GEMV and `torch.topk` are four
    launches); the same values, ties aside (argmax takes the lowest id)."""
    if fused:
        logits = (x.float()[:, None, :] * weight.float()[None]).sum(-1)  # [T, E]
        if not c.logits_fp32:
            logits = logits.to(x.dtype).float()  # as the model-dtype GEMV rounds it
    elif c.logits_fp32:
        logits = F.linear(x.float(), weight.float())  # [T, E]
    else:
        logits = F.linear(x, weight).float()
    scores = logits.softmax(dim=-1) if c.scoring == "softmax" else logits.sigmoid()
    choice = scores + bias.float() if bias is not None else scores
    if c.limits_groups:
        choice = _limit_groups(choice, c)
    ids = top_k_ids(choice, c.top_k) if fused else torch.topk(choice, c.top_k, dim=-1).indices
    weights = scores.gather(1, ids)  # the bias only steers the choice
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if c.scale_when_normalized or not c.norm_topk_prob:
        weights = weights * c.scaling_factor
    if c.round_weights:
        weights = weights.to(x.dtype).float()
    return ids, weights


def top_k_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [T, k] of the k largest scores [T, E], best first, by k argmax passes."""
    iota = torch.arange(scores.shape[-1], device=scores.device)
    ids = []
    for _ in range(k):
        best = scores.argmax(dim=-1, keepdim=True)  # [T, 1]
        ids.append(best)
        scores = scores.masked_fill(iota == best, float("-inf"))
    return torch.cat(ids, dim=-1)


def _limit_groups(choice: torch.Tensor, c: RouterConfig) -> torch.Tensor:
    grouped = choice.view(choice.shape[0], c.num_groups, -1)  # [T, G, E/G]
    if c.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.topk(group_scores, c.topk_groups, dim=-1).indices  # [T, topk_groups]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    fill = float("-inf") if c.topk_method == "noaux_tc" else 0.0
    return grouped.masked_fill(~mask[..., None], fill).view_as(choice)
