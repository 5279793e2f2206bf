"""`FusedDecoder`: a decode step as one compiled function per decoder layer (GPU floor cut).

Each decoder layer runs as ONE pure function of tensors (engine/executor/layer_functions.py,
in place of the module path's ~73 GPU kernels per layer at batch 1, ops/decoder_layer.py): from
the residual add of the previous layer's MoE output to the packed router output; then, outside
it: the CPU experts' start (one copy, `MoEStep.forward_packed`), the cache write (one
kernel, off the CPU's critical path), the shared experts, the wait. On a GPU (Triton kernels,
HETMOE_DECODE_KERNELS) the attention chunk count is dynamic where Inductor keeps it so (else one
graph per bucket); `FusedDecoder` owns the router kernel's row tickets.
On a GPU the layer functions go through `torch.compile` (Inductor); the weights are arguments,
so every layer of a model shares one compiled graph. Attention reads the first `kv_len` cache
entries (the runner's window bucket, ops/kv_batch.py) in chunks of 64 whose count is a dynamic
dimension, so every bucket shares that graph too. Without compile (CPU) the same functions run
eagerly.

`engine/executor/layer_plan.py` says whether a model fits; `ModelRunner` uses the module path
otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hetmoe import env
from hetmoe.engine.executor.layer_functions import (
    final_norm,
    make_gqa_layer,
    make_mla_layer,
    shared_mlp,
)
from hetmoe.engine.executor.layer_plan import LayerPlan, LayerStatics, plan_layers
from hetmoe.ops import fused
from hetmoe.ops.kv_batch import KVBatch
from hetmoe.ops.moe_step import MoEStep
from hetmoe.ops.norm import eps_of

# Imported inside the functions that use them, so an uncompiled runner on the CPU loads neither:
# the Triton kernels (kernels/ loads Triton, absent from CPU-only installs) where they run, and
# torch._dynamo (a second or more to import) where the layer functions are compiled.

RECOMPILE_LIMIT = 64
"""Compiled variants allowed per layer function (batch sizes x layer kinds x MoE terms; the
attention window is a dynamic dimension, not a variant)."""

_FUNCTIONS: dict[Any, Callable[..., Any]] = {}
"""Layer functions by (statics or name, compiled), shared by every `FusedDecoder` of the process
(another runner on the same model shapes reuses the compiled code instead of compiling again)."""


def explain_compile_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (compiled lazily, at each new input shape) with compiler failures re-raised as a
    RuntimeError that names the requirement and the way out; other errors pass unchanged."""
    from torch._dynamo.exc import TorchDynamoException

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except TorchDynamoException as exc:
            cause = getattr(exc, "inner_exception", None) or exc  # the compiler's own error
            raise RuntimeError(
                "torch.compile of the decode step failed (it needs Triton and a C compiler on "
                f"this machine): {type(cause).__name__}: {cause}; LLM(..., compile_decode=False) "
                "runs the same step uncompiled"
            ) from exc

    return call


def _inductor_options(dependent: bool) -> dict[str, Any]:
    """Inductor's options for the layer functions: where the Triton kernels launch as
    programmatic dependents (kernels/pdl.py), Inductor's own kernels between them do too (its
    `triton.enable_pdl`, where this torch has it), so no plain launch breaks the chain."""
    import torch._inductor.config as inductor

    return {"triton.enable_pdl": True} if dependent and hasattr(inductor.triton, "enable_pdl") \
        else {}


class FusedDecoder:
    """Runs decode steps of `model` through the layer functions, MoE layers via `overlap`."""

    def __init__(self, model: Any, overlap: MoEStep, compile: bool,
                 kernels: str | None = None) -> None:
        """`compile`: run the layer functions through torch.compile (GPU), else eagerly.
        `kernels`: `triton` or `torch` (GQA layers, `make_gqa_layer`); None: on a CUDA GPU as
        HETMOE_DECODE_KERNELS says (triton by default), torch ops elsewhere."""
        self.base = getattr(model, model.base_model_prefix)
        self.plans = plan_layers(model)
        self.overlap = overlap
        self.moe_index = {id(m): i for i, m in enumerate(overlap.layers)}
        self.compile = compile
        if kernels is None:
            on_gpu = self.base.embed_tokens.weight.device.type == "cuda"
            kernels = env.decode_kernels() if on_gpu else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"FusedDecoder: kernels must be triton or torch, got {kernels!r}")
        self.kernels = kernels
        self.gqa_only = all(plan.statics.attention != "mla" for plan in self.plans)
        """Whether every layer runs the GQA kernels (MLA layers are Inductor's torch ops: their
        steps have not been measured with dependent launches, so they keep plain ones)."""
        self.dependent = False
        """Whether the step running launches its kernels as programmatic dependents
        (`_dependent_launch`, decided at each step's start; its compiled layer functions
        are Inductor's with the same setting)."""
        self.tickets: list[torch.Tensor] = []
        """kernels/moe_router.py's row tickets (`row_tickets`), the last the one in use: every
        one made is kept, as a captured CUDA graph replays the address it was captured with."""
        if compile:
            import torch._dynamo

            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)

    def _fn(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        dependent = self.dependent
        fn = _FUNCTIONS.get((key, self.compile, dependent))
        if fn is None:
            fn = make()
            if self.compile:
                fn = explain_compile_errors(torch.compile(
                    fn, fullgraph=True, dynamic=False, options=_inductor_options(dependent)))
            _FUNCTIONS[(key, self.compile, dependent)] = fn
        return fn

    def _dependent_launch(self) -> bool:
        """Whether this step's kernels launch as programmatic dependents (kernels/pdl.py): on a
        GPU of compute capability 9.0+, in models of GQA layers, where no layer has CPU work
        (every routed expert resident; with CPU experts it measured slower, see kernels/pdl.py),
        or with CPU work too under HETMOE_DEPENDENT_LAUNCH=always."""
        if self.kernels != "triton" or not self.gqa_only:
            return False
        placement = getattr(self.overlap, "placement", None)
        resident = placement is not None and placement.everything
        if not resident and env.dependent_launch() != "always":
            return False
        from hetmoe.kernels import pdl

        return pdl.supported(self.base.embed_tokens.weight.device)

    def _layer_fn(self, statics: LayerStatics) -> Callable[..., tuple[Any, ...]]:
        if statics.attention == "mla":
            return self._fn(statics, lambda: make_mla_layer(statics))
        kernel = self.kernels == "triton"
        return self._fn((statics, kernel), lambda: make_gqa_layer(statics, kernel))

    def forward(self, ids: torch.Tensor, kv: KVBatch,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """ids [B, 1] -> final hidden states [B, 1, H], the module path's `_forward` result;
        attention reads the first `kv.kv_len` cache entries (the step's window bucket).
        `before_layer(n)` runs before decoder layer n (a graph capture splits there)."""
        self.dependent = self._dependent_launch()
        if not self.dependent:
            return self._forward(ids, kv, before_layer)
        from hetmoe.kernels import pdl

        with pdl.allowed(True):
            return self._forward(ids, kv, before_layer)

    def _forward(self, ids: torch.Tensor, kv: KVBatch,
                 before_layer: Callable[[int], None] | None) -> torch.Tensor:
        b = ids.shape[0]
        h = self.base.embed_tokens(ids)  # [B, 1, H]
        rotary = self.base.rotary_emb(h, kv.positions)
        if isinstance(rotary, torch.Tensor):  # complex freqs_cis [B, 1, D/2]
            cos, sin = rotary.real.float(), rotary.imag.float()
        else:
            cos, sin = rotary
        h = h[:, 0]  # [B, H]
        pos = kv.positions[:, 0]  # [B]
        windows: dict[int | None, tuple[torch.Tensor, ...]] = {}
        terms: tuple[torch.Tensor, ...] = ()
        overlap = self.overlap
        for n, plan in enumerate(self.plans):
            if before_layer is not None:
                before_layer(n)
            window = plan.window
            caches = plan.caches()
            if window not in windows:
                windows[window] = self._window(pos, kv.kv_len, window)
            statics = plan.statics
            router = plan.router if plan.moe is not None else (None, None)
            if self.kernels == "triton" and plan.moe is not None:
                router = (*router, self._tickets(b, h.device))
            h, x, new, stage = self._layer_fn(statics)(
                h, terms, plan.norms, plan.weights, cos, sin, caches, kv.slots, windows[window],
                router)
            if plan.moe is None:
                self._write(caches, new, kv.slots, pos)
                assert plan.dense is not None
                dense = plan.dense
                terms = (self._fn("mlp", lambda: shared_mlp)(x, dense, None),)
                continue
            between = functools.partial(self._between, plan, x, caches, new, kv.slots, pos)
            i = self.moe_index[id(plan.moe)]
            terms = tuple(overlap.forward_packed(i, stage, x.shape[0], between))
        norm = self.base.norm
        out = self._fn("final", lambda: final_norm)(h, terms, norm.weight.detach(), eps_of(norm))
        return out.view(b, 1, -1)

    def _tickets(self, rows: int, device: torch.device) -> torch.Tensor:
        """Row tickets for `rows` rows, made (zeros) when the last ones are too few: at a batch
        size's first step, which runs eagerly before its graph is captured."""
        if not self.tickets or self.tickets[-1].shape[0] < rows:
            from hetmoe.kernels.moe_router import row_tickets

            self.tickets.append(row_tickets(max(rows, 64), device))
        return self.tickets[-1]

    def _window(self, pos: torch.Tensor, width: int, window: int | None
                ) -> tuple[torch.Tensor, ...]:
        """What a layer's attention takes over the first `width` cache entries: the
        `fused.window_mask` (compiled, its chunk count is marked dynamic, so every window bucket
        shares one compiled graph), then for the Triton kernel each row's bounds lo, pos [B]."""
        allowed = fused.window_mask(pos, width, window)  # [B, n, c]
        if self.compile:
            from torch._dynamo import mark_dynamic, maybe_mark_dynamic

            # the Triton path's chunk count reaches kernel arguments: where Inductor still
            # specializes one, that window bucket compiles its own graph instead of failing
            (mark_dynamic if self.kernels == "torch" else maybe_mark_dynamic)(allowed, 1)
        if self.kernels == "torch":
            return (allowed,)
        return allowed, fused.window_bounds(pos, window), pos

    def _between(self, plan: LayerPlan, x: torch.Tensor, caches: tuple[torch.Tensor, ...],
                 new: tuple[torch.Tensor, ...], slots: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor | None:
        """GPU work while the CPU experts run: the cache write, then the shared experts."""
        self._write(caches, new, slots, pos)
        if plan.shared is None:
            return None
        fn = self._fn(("shared", plan.shared_gate is None), lambda: shared_mlp)
        return fn(x, plan.shared, plan.shared_gate)

    @staticmethod
    def _write(caches: tuple[torch.Tensor, ...], new: tuple[torch.Tensor, ...],
               slots: torch.Tensor, pos: torch.Tensor) -> None:
        """Stores the step's new cache entries (one kernel per cache tensor; none when the
        attention kernel stored them: `new` is empty)."""
        if not new:
            return
        for cache, entry in zip(caches, new, strict=True):
            cache.index_put_((slots, pos), entry)
