"""Expert Deferral's formula in plain torch: the oracle of the runtime's deferral."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from hetmoe.ops.deferral import check_deferred, deferred_misses
from hetmoe.ops.moe import HybridMoE, moe_layers


class DeferralReference:
    """The formula above in plain torch: synchronous `experts.forward` calls, no overlap.

    Installed on every `HybridMoE` of a model (`with DeferralReference(model, d).decoding():`),
    it computes each layer's output over the router's top-K with the deferred set masked (-1),
    holding the deferred output of the previous MoE layer in a Python variable.

    With `resident` (per MoE layer, the experts resident on the GPU) the "misses" order: each
    token's lowest-scored min(d, misses) non-resident experts are deferred (ops/deferral.py).
    """

    def __init__(self, model: nn.Module, deferred: int,
                 resident: Sequence[Sequence[int]] | None = None) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("DeferralReference: the model has no hybrid_moe layer")
        self.deferred = deferred
        self.resident = resident
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.carry: torch.Tensor | None = None  # R^def_{k-1}(I_{k-1}) [T, H]

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Routes every MoE layer through `forward` while inside (decode steps only)."""
        for moe in self.layers:
            moe.step = self
        try:
            yield
        finally:
            for moe in self.layers:
                moe.step = None
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
        late = torch.zeros_like(ids, dtype=torch.bool)  # [T, K] the deferred set
        if self.resident is None:
            late[:, k - d:] = True  # "score": the d lowest-scored
        else:
            resident = torch.tensor(list(self.resident[self.index[id(moe)]]), dtype=torch.int64)
            late = deferred_misses(~torch.isin(ids.cpu(), resident), d).to(ids.device)
        where = moe.experts.device
        xs, w = x.to(where), weights.to(where)
        out = moe.experts.forward(xs, torch.where(late, -1, ids).to(where), w).to(x.device)
        if self.carry is not None:
            out = out + self.carry
        shared = moe.shared(x)
        if shared is not None:
            out = out + shared
        self.carry = None
        if d:
            carry = moe.experts.forward(xs, torch.where(late, ids, -1).to(where), w)
            self.carry = carry.to(x.device)
        return out.reshape(shape)
