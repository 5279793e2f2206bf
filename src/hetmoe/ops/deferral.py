"""Expert Deferral (decode only): which experts of a layer run late.

With `deferred = d`, some experts of the K a token picks at MoE layer k are *deferred*: submitted
right after the immediate ones, their output is added to MoE layer k+1's output, so the CPU
computes them while the GPU runs layer k+1's attention. Per MoE layer k (I_k its input, S shared
experts, R routed experts, D_k(t) the deferred set of token t):

    O_k = I_k + S_k(I_k) + R^def_{k-1}(I_{k-1}) + R^imm_k(I_k)

with R^def over D_k(t) and R^imm over the rest (the residual I_k is added by the unchanged
decoder layer). The deferral order (`DEFER_ORDERS`, `EngineConfig.defer_order`) says which:

- "score" (the KTransformers paper's rule): the token's d lowest-scored experts. The routers
  return their top-K sorted by score, so these are the last d columns.
- "misses" (the default): the token's lowest-scored min(d, m) CPU misses (m: its experts not
  resident on the GPU, engine/placement/slots.py); resident experts always run in their own
  layer. With no expert resident this is "score"; with every expert resident nothing is deferred.
  `deferred_misses` is the set; `misses_last` reorders a token's slots so the CPU link's fixed
  rule (its last d slots late) computes it.

The last MoE layer defers nothing, at least 2 experts stay immediate, and prefill never defers.
"""

from __future__ import annotations

import torch

from hetmoe.config import DEFER_ORDERS

MIN_IMMEDIATE = 2
"""Experts per token that always run in their own layer."""


def check_deferred(deferred: int, top_k: int, where: str = "deferred") -> None:
    """ValueError unless 0 <= deferred <= top_k - MIN_IMMEDIATE."""
    if not isinstance(deferred, int) or deferred < 0:
        raise ValueError(f"{where} must be a non-negative integer, got {deferred!r}")
    if top_k - deferred < MIN_IMMEDIATE:
        raise ValueError(
            f"{where}={deferred} leaves {top_k - deferred} immediate experts of the router's "
            f"top-{top_k}; at least {MIN_IMMEDIATE} must stay immediate "
            f"(deferred <= {max(top_k - MIN_IMMEDIATE, 0)})"
        )


def check_defer_order(order: object, where: str = "defer_order") -> None:
    """ValueError unless `order` is one of DEFER_ORDERS."""
    if order not in DEFER_ORDERS:
        raise ValueError(f"{where} must be one of {', '.join(DEFER_ORDERS)} (which experts "
                         f"Expert Deferral defers), got {order!r}")


def split_ids(expert_ids: torch.Tensor, deferred: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(immediate, deferred) copies of expert_ids [T, K], the other part's slots set to -1.

    Both keep the shape [T, K], so one fixed buffer binding serves both CPU calls of a layer.
    """
    k = expert_ids.shape[-1]
    immediate = expert_ids.clone()
    immediate[:, k - deferred:] = -1
    late = expert_ids.clone()
    late[:, : k - deferred] = -1
    return immediate, late


def deferred_misses(miss: torch.Tensor, deferred: int) -> torch.Tensor:
    """The "misses" order's deferred set: miss [T, K] bool (slots in score order, True: the
    expert is not resident) -> [T, K] bool, each row's last min(deferred, misses) misses."""
    after = miss.flip(-1).long().cumsum(-1).flip(-1)  # [T, K] misses at or after each slot
    return miss & (after <= deferred)


def misses_last(ids: torch.Tensor, weights: torch.Tensor, miss: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) [T, K] with each row's resident slots first and its misses (miss [T, K]
    bool) last, each part in its score order: the last d slots then hold `deferred_misses`
    (and, for a row of fewer than d misses, residents, which the GPU computes at once).
    Device ops only, fixed shapes (CUDA-graph capturable)."""
    k = ids.shape[-1]
    key = miss.long() * k + torch.arange(k, device=ids.device)  # [T, K], distinct per row
    order = key.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)
