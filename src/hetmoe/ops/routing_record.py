"""`record_routing`: the expert ids each MoE layer's router picks during forward passes.

Inside the context a forward hook on every `HybridMoE` router keeps each call's expert ids
[T, K] as the router returns them (on its device: no copy, no sync), in call order. Its readers:
pre-placement's routing counts (engine/preplacement.py), the distinct experts per ubatch
(bench/expert_count.py) and the routing statistics of benchmarks/demo_moe/routing.py. Hooks fire
on module calls only: a compiled decode step routes through `router.route` as a function and
records nothing; the placement counts its routing inside the captured step instead, on the
device (engine/placement/slots.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hetmoe.ops.moe import HybridMoE, moe_layers


class RoutingRecord:
    """The router calls of each MoE layer of a model inside `record_routing`."""

    def __init__(self, layers: Sequence[HybridMoE]) -> None:
        self.layers = list(layers)
        """The model's MoE layers in execution order (none: the model has no hybrid_moe)."""
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.layers]
        """Per MoE layer, each router call's expert ids [T, K] int64, in call order."""

    def picks(self) -> list[torch.Tensor]:
        """Expert ids [N, K] per MoE layer: its calls joined (token order when a pass's
        chunks run in turn)."""
        return [self._ids(i) for i in range(len(self.layers))]

    def counts(self) -> list[torch.Tensor]:
        """Picks per expert [E] int64 per MoE layer (a bincount of the recorded ids), on the
        router's device."""
        return [torch.bincount(self._ids(i).reshape(-1), minlength=m.experts.spec.num_experts)
                for i, m in enumerate(self.layers)]

    def clear(self) -> None:
        """Drops the calls recorded so far (a long sample counted step by step keeps none)."""
        for calls in self.calls:
            calls.clear()

    def _ids(self, i: int) -> torch.Tensor:
        """Layer i's recorded ids, joined without a copy when there is one call."""
        calls = self.calls[i]
        if len(calls) == 1:
            return calls[0]
        if not calls:
            return torch.empty(0, dtype=torch.int64, device=self.layers[i].gate.weight.device)
        return torch.cat(calls)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Inside, every call of each MoE layer's router of `model` adds its expert ids to the
    yielded record; the hooks are removed on leaving."""
    record = RoutingRecord(moe_layers(model))

    def keep(calls: list[torch.Tensor]) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            calls.append(out[0])  # [T, K] expert ids
        return hook

    handles = [m.gate.register_forward_hook(keep(calls))
               for m, calls in zip(record.layers, record.calls, strict=True)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()
