"""Expert Deferral (decode only): which experts of a layer run late.

With `deferred = d`, of the K experts a token picks at MoE layer k the top K−d by router score are
*immediate*; the lowest-scored d are *deferred*: submitted right after the immediate ones, their
output is added to MoE layer k+1's output, so the CPU computes them while the GPU runs layer
k+1's attention. The routers return their top-K sorted by score, so the deferred experts are the
last d columns. Per MoE layer k (I_k its input, S shared experts, R routed experts):

    O_k = I_k + S_k(I_k) + R^def_{k-1}(I_{k-1}) + R^imm_k(I_k)

(the residual I_k is added by the unchanged decoder layer). The last MoE layer defers nothing, at
least 2 experts stay immediate, and prefill never defers.
"""

from __future__ import annotations

import torch

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
