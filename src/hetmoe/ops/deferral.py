"""Expert Deferral (decode only): which experts of a layer run late, and its pure-torch reference.

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

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from hetmoe.ops.moe import HybridMoE

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


def moe_layers(model: nn.Module) -> list[HybridMoE]:
    """The model's hybrid MoE modules in execution order."""
    from hetmoe.ops.moe import HybridMoE

    return [m for m in model.modules() if isinstance(m, HybridMoE)]


class DeferralReference:
    """The formula above in plain torch: synchronous `experts.forward` calls, no overlap.

    Installed on every `HybridMoE` of a model (`with DeferralReference(model, d).decoding():`),
    it computes each layer's output with column slices of the router's top-K, holding the
    deferred output of the previous MoE layer in a Python variable.
    """

    def __init__(self, model: nn.Module, deferred: int) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("DeferralReference: the model has no hybrid_moe layer")
        self.deferred = deferred
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.carry: torch.Tensor | None = None  # R^def_{k-1}(I_{k-1}) [T, H]

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Routes every MoE layer through `forward` while inside (decode steps only)."""
        for moe in self.layers:
            moe.runtime = self
        try:
            yield
        finally:
            for moe in self.layers:
                moe.runtime = None
            self.carry = None

    def forward(self, moe: HybridMoE, hidden_states: torch.Tensor) -> torch.Tensor:
        """O_k − I_k for MoE layer `moe` (see the module docstring)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        ids, weights = moe.gate(x)  # [T, K]
        last = self.index[id(moe)] == len(self.layers) - 1
        d = 0 if last else self.deferred
        k = ids.shape[1]
        check_deferred(d, k)
        experts = moe.experts
        where = experts.device
        xs = x.to(where)
        out = experts.forward(xs, ids[:, : k - d].to(where), weights[:, : k - d].to(where))
        out = out.to(x.device)
        if self.carry is not None:
            out = out + self.carry
        shared = moe._shared(x)
        if shared is not None:
            out = out + shared
        self.carry = None
        if d:
            late = experts.forward(xs, ids[:, k - d:].to(where), weights[:, k - d:].to(where))
            self.carry = late.to(x.device)
        return out.reshape(shape)
