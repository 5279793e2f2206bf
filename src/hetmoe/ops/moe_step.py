"""The MoE step, written once: route -> start routed experts -> shared experts -> wait -> add the
previous layer's deferred output -> combine.

Per MoE layer k (I_k its input, S shared experts, R routed experts):

    O_k = I_k + R^imm_k(I_k) + R^def_{k-1}(I_{k-1}) + S_k(I_k)

(the residual I_k is added by the decoder layer). With Expert Deferral (`deferred = d`, decode
only) up to d of a token's K experts are *deferred* (the d lowest-scored, or in the "misses"
order its lowest-scored CPU misses: ops/deferral.py): they run after layer k's immediate experts
while layer k+1's attention runs, and their output joins layer k+1. The last MoE layer defers
nothing and at least 2 experts stay immediate.

A `Link` moves one layer's inputs to its routed experts, starts them and brings the output
back; a start with `deferred=d` computes the immediate slots, then the deferred ones
(`finish_late`). `BackendLink` drives any expert backend from Python (`submit` / `sync`: prefill,
and every step without a GPU); `engine/executor/host_link.py`'s `HostLink` does the same in CUDA
stream order for graph decode. Both the HF-module path (`HybridMoE.forward`) and the fused decode
step (`forward_packed`) run the one `MoEStep._combine`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.expert_function import fp32_experts, needs_grad, routed_experts
from hetmoe.ops.deferral import check_deferred, split_ids
from hetmoe.ops.fused import sum_terms, unpack_moe_inputs

if TYPE_CHECKING:
    from hetmoe.experts.backend import ExpertBackend
    from hetmoe.ops.router import Router


class StepLayer(Protocol):
    """What the MoE step uses of a MoE layer (ops/moe.py's `HybridMoE`, which imports this module
    for its plain step): its router, routed experts, shared experts and the step attached."""

    gate: Router
    experts: ExpertBackend
    step: MoEStep | None

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output on x [T, H] (None: the layer has none)."""


class Link(Protocol):
    """One MoE layer's transport to its routed experts."""

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        """Starts the experts on x [T, H] with ids / weights [T, K] (the last `deferred` slots
        after the others, for `finish_late`)."""

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        """`start` on a `fused.pack_moe_inputs` vector of `rows` tokens."""

    def finish(self) -> torch.Tensor:
        """Waits for the immediate slots of the last start; their output [T, H]."""

    def finish_late(self) -> torch.Tensor | None:
        """Waits for the deferred slots of the last start; their output [T, H] (None: the start
        deferred nothing after all, e.g. every expert resident in the "misses" order)."""


class BackendLink:
    """A `Link` over an expert backend's `submit` / `sync`, called from Python; deferred slots
    are submitted when the immediate ones are taken, so they overlap the next layer's
    attention."""

    def __init__(self, experts: ExpertBackend, hidden: int, top_k: int) -> None:
        self.experts = experts
        self.hidden, self.top_k = hidden, top_k
        self.device = torch.device("cpu")
        self._late: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Training (experts/expert_function.py): the call's inputs, for the autograd op.
        self._grad: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fp32 = False

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              deferred: int = 0) -> None:
        self.device = x.device
        where = self.experts.device
        x, weights = x.to(where), weights.to(where)
        immediate, late = self.split(ids, deferred) if deferred else (ids, None)
        self._late = (x, late.to(where), weights) if late is not None else None
        self._grad = None
        if needs_grad(self.experts, x, weights):
            self._grad, self._fp32 = (x, immediate, weights), fp32_experts(x)
            if self._fp32:
                return  # computed in fp32 at finish
        self.experts.submit(x, immediate.to(where), weights)

    def split(self, ids: torch.Tensor, deferred: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(immediate, deferred) ids [T, K] of a start, -1 in the other part's slots: the last
        `deferred` slots late (a benchmark's link may choose other slots)."""
        return split_ids(ids, deferred)

    def start_packed(self, stage: torch.Tensor, rows: int, deferred: int = 0) -> None:
        x, ids, weights = unpack_moe_inputs(stage, rows, self.hidden, self.top_k)
        self.start(x, ids, weights, deferred)

    def finish(self) -> torch.Tensor:
        if self._grad is not None:
            assert isinstance(self.experts, CpuExperts)
            done = None if self._fp32 else self.experts.sync()
            out = routed_experts(self.experts, *self._grad, done).to(self.device)
        else:
            out = self.experts.sync().to(self.device)
        if self._late is not None:
            self.experts.submit(*self._late)
            self._late = None
        return out

    def finish_late(self) -> torch.Tensor:
        return self.experts.sync().to(self.device)


def backend_link(moe: StepLayer) -> BackendLink:
    """A `BackendLink` over `moe`'s routed experts."""
    return BackendLink(moe.experts, moe.experts.spec.hidden_size, moe.gate.config.top_k)


class MoEStep:
    """Runs a model's MoE layers (`layers`, in execution order) over their links.

    `links(i)` gives MoE layer i's link for the current pass (decode steps may use another
    transport than prefill). `deferred` applies inside `phase(decoding=True)` only. `trace`,
    when set, receives marks (`mark(label, layer)`) around each stage.
    """

    def __init__(self, layers: Sequence[StepLayer], links: Callable[[int], Link],
                 deferred: int = 0) -> None:
        if not layers:
            raise ValueError("MoEStep: the model has no hybrid_moe layer")
        self.layers = list(layers)
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.top_k = self.layers[0].gate.config.top_k
        self.deferred = deferred
        self.links = links
        self.decoding = False
        self.trace: Any = None
        self._carry: Callable[[], torch.Tensor | None] | None = None  # awaits layer k-1's
        # deferred experts (in flight)

    @property
    def deferred(self) -> int:
        """Experts per token each MoE layer defers in decode (ops/deferral.py)."""
        return self._deferred

    @deferred.setter
    def deferred(self, deferred: int) -> None:
        check_deferred(deferred, self.top_k)  # the one check of the router's bound
        self._deferred = deferred

    def attach(self) -> None:
        """Makes every MoE layer's forward run through this step."""
        for moe in self.layers:
            moe.step = self

    def detach(self) -> None:
        """Gives the MoE layers back their plain step (no overlap, no deferral)."""
        for moe in self.layers:
            moe.step = None

    @contextmanager
    def phase(self, decoding: bool) -> Iterator[None]:
        """Marks the forward passes inside as decode steps (deferral allowed) or prefill."""
        before, self.decoding = self.decoding, decoding
        self._carry = None  # a step that raised must not hand its deferred experts to the next
        try:
            yield
        except BaseException:
            for moe in self.layers:  # a call submitted and never synced must not block the next
                moe.experts.discard()
            raise
        finally:
            self.decoding = before

    def deferred_at(self, i: int) -> int:
        """Experts per token MoE layer i defers: `deferred` in decode, 0 in prefill and at the
        last MoE layer."""
        return self.deferred if self.decoding and i < len(self.layers) - 1 else 0

    def forward(self, moe: StepLayer, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE output (without the residual) of `hidden_states` [..., H] at layer `moe`."""
        shape = hidden_states.shape
        i = self.index[id(moe)]
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        ids, weights = moe.gate(x)  # [T, K] int64 sorted by score, [T, K] fp32
        link = self.links(i)
        self._mark("moe_start", i)
        link.start(x, ids, weights, self.deferred_at(i))
        terms = self._combine(i, link, lambda: moe.shared(x))
        return sum_terms(terms, hidden_states.dtype).reshape(shape)  # as the fused step sums

    def forward_packed(self, i: int, stage: torch.Tensor, rows: int,
                       shared: Callable[[], torch.Tensor | None]) -> list[torch.Tensor]:
        """MoE layer i of a fused decode step (engine/executor/fused_decode.py), whose compiled
        layer already routed: `stage` = `pack_moe_inputs(x, ids, weights)` of `rows` tokens with all
        K ids. Returns the terms the caller adds to the residual (routed, the previous layer's
        deferred output, shared)."""
        link = self.links(i)
        self._mark("moe_start", i)
        link.start_packed(stage, rows, self.deferred_at(i))
        return self._combine(i, link, shared)

    def _combine(self, i: int, link: Link,
                 shared: Callable[[], torch.Tensor | None]) -> list[torch.Tensor]:
        """After layer i's start: shared experts meanwhile, wait, carry, in that order."""
        self._mark("submitted", i)
        out = shared()  # on the op's device, while the routed experts compute
        self._mark("shared_done", i)
        terms = [link.finish()]
        self._mark("waited", i)
        if self.deferred_at(i):
            self._mark("deferred_submitted", i)  # the same job goes on to them
        if self._carry is not None:
            late = self._carry()
            if late is not None:
                terms.append(late)
            self._mark("deferred_waited", i - 1)
        self._carry = link.finish_late if self.deferred_at(i) else None
        if out is not None:
            terms.append(out)
        self._mark("moe_end", i)
        return terms

    def _mark(self, label: str, layer: int) -> None:
        if self.trace is not None:
            self.trace.mark(label, layer)
