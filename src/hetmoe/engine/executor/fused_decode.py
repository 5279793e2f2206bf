"""`FusedDecoder`: a decode step as one compiled function per decoder layer (GPU floor cut).

The module path runs each HF decoder layer's modules (ops/decoder_layer.py): ~73 GPU kernels per
layer at batch 1 (norms, projections, q/k norms, rope, cache writes, the mask, attention, router,
three input copies). Here a layer is ONE pure function of tensors (ops/fused.py), from the
residual add of the previous layer's MoE output to the packed router output:

    h += previous MoE terms -> RMSNorm -> q/k/v (one GEMV) -> q/k norm -> rope -> attention over
    the cache plus the new token -> o_proj -> h += attn -> RMSNorm -> router -> pack(x, ids, w)

then, outside it: the CPU experts' start (one copy, `MoEStep.forward_packed`), the
cache write (one kernel, off the CPU's critical path), the shared experts, the wait. On a GPU
(HETMOE_DECODE_KERNELS, env.decode_kernels: triton by default) q/k norms, rope and GQA attention
are kernels/gqa_decode.py, which stores the new cache entries itself, and the MoE layer's
residual, norm, router and pack kernels/moe_router.py (one launch over the decoder's row
tickets), and for batches of up to `kernels.gemv_config.DECODE_GEMV_MAX_ROWS` bf16 rows the input
norm with q/k/v kernels/norm_gemv.py and o_proj kernels/gemv_residual.py (larger batches: cuBLAS),
inside the compiled graph (`triton_op`s); the chunk count is then dynamic where Inductor keeps it
so (else one graph per bucket).
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
from hetmoe.engine.executor.layer_plan import LayerPlan, LayerStatics, plan_layers
from hetmoe.ops import fused
from hetmoe.ops.kv_batch import KVBatch
from hetmoe.ops.moe_step import MoEStep
from hetmoe.ops.norm import eps_of
from hetmoe.ops.router import route

# Imported inside the functions that use them, so an uncompiled runner on the CPU loads neither:
# the Triton kernels (kernels/ loads Triton, absent from CPU-only installs) where they run, and
# torch._dynamo (a second or more to import) where the layer functions are compiled.

RECOMPILE_LIMIT = 64
"""Compiled variants allowed per layer function (batch sizes x layer kinds x MoE terms; the
attention window is a dynamic dimension, not a variant)."""

_FUNCTIONS: dict[Any, Callable[..., Any]] = {}
"""Layer functions by (statics or name, compiled), shared by every `FusedDecoder` of the process
(another runner on the same model shapes reuses the compiled code instead of compiling again)."""


def _layer_tail(s: LayerStatics, h: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor,
                post_norm: torch.Tensor, new: tuple[torch.Tensor, ...],
                router: tuple[torch.Tensor | None, ...],
                entry: Callable[..., tuple[torch.Tensor, ...]] | None = None,
                gemv: Callable[..., torch.Tensor] | None = None) -> tuple[Any, ...]:
    """Every layer function's end: o_proj + residual, the post-attention norm, and on MoE layers
    the router with the CPU experts' packed inputs (all K ids: the CPU job splits off deferred
    ones); `entry(h, o, post_norm, *router) -> (h, x, stage)`: kernels doing all but o_proj
    (`make_gqa_layer`). `router`: (weight, bias), then on the kernels' path the row tickets.
    `gemv`: o_proj as kernels/gemv_residual.py's `gemv_residual(attn, o_w, h or None)`, with
    the residual add where no `entry` does it; None: torch's linear.
    Returns (h, x, new cache entries, stage or None)."""
    if s.router is not None and entry is not None:
        h, x, stage = entry(h, _o_proj(attn, o_w, None, gemv), post_norm, *router)
        return h, x, new, stage
    h = _o_proj(attn, o_w, h, gemv)
    x = fused.rms_norm(h, post_norm, s.eps[1])
    if s.router is None:
        return h, x, new, None
    router_w, router_b = router[:2]
    assert router_w is not None
    ids, weights = route(x, router_w, router_b, s.router, fused=True)
    return h, x, new, fused.pack_moe_inputs(x, ids, weights)


def _o_proj(attn: torch.Tensor, o_w: torch.Tensor, h: torch.Tensor | None,
            gemv: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """(h +) attn @ o_w^T: by `gemv` (kernels/gemv_residual.py) if given, else torch's linear."""
    if gemv is not None:
        return gemv(attn, o_w, h)
    o = fused.linear(attn, o_w, None)
    return o if h is None else h + o


def make_gqa_layer(s: LayerStatics, kernel: bool = False,
                   gemv: bool = True) -> Callable[..., tuple[Any, ...]]:
    """The pure layer function of a GQA layer with statics `s` (see the module docstring).
    `kernel`: q/k norms, rope, attention and the cache write by kernels/gqa_decode.py (the
    function returns no entries to write) over `window` = (mask, lo, pos)
    (`FusedDecoder._window`), and on MoE layers with a greedy router the residual, norm,
    router and pack by kernels/moe_router.py (one launch when `router` ends with its row
    tickets, else two); with `gemv` too, the input norm + q/k/v projection and o_proj (+ the
    residual add where moe_router does not do it) by kernels/norm_gemv.py and
    kernels/gemv_residual.py for the batches `gemv_config.gemv_fits` takes (up to
    `DECODE_GEMV_MAX_ROWS` bf16 rows; larger batches keep torch's linear: a rule on the traced
    shape, not a fallback); else the torch ops over `window` = (mask,)."""
    kv_heads, head_dim = s.dims
    if kernel and s.rope != "half":
        raise ValueError(f"the GQA decode kernel rotates rotate-half rope, not {s.rope!r}")
    entry = None
    if kernel:
        from hetmoe.kernels import moe_router
        from hetmoe.kernels.gemv_config import gemv_fits
        from hetmoe.kernels.gemv_residual import gemv_residual
        from hetmoe.kernels.gqa_decode import gqa_decode_attention
        from hetmoe.kernels.norm_gemv import norm_gemv

        if s.router is not None and s.router.kernel_fits():
            args = s.router.kernel_args()

            def entry(h: torch.Tensor, o: torch.Tensor, norm: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None,
                      tickets: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
                return moe_router.moe_router(h, o, norm, s.eps[1], weight, bias, tickets,
                                             *args)

    def layer(h: torch.Tensor, terms: tuple[torch.Tensor, ...], norms: tuple[torch.Tensor, ...],
              weights: tuple[torch.Tensor | None, ...], cos: torch.Tensor, sin: torch.Tensor,
              caches: tuple[torch.Tensor, ...], slots: torch.Tensor,
              window: tuple[torch.Tensor, ...],
              router: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        qkv_w, qkv_b, qn_w, kn_w, o_w = weights
        assert qkv_w is not None and o_w is not None
        b = h.shape[0]
        h = fused.residual(h, terms)  # [B, H]
        projected = kernel and gemv and gemv_fits(h, qkv_w) and gemv_fits(h, o_w)
        if projected:
            qkv = norm_gemv(h, norms[0], s.eps[0], qkv_w, qkv_b)
        else:
            qkv = fused.linear(fused.rms_norm(h, norms[0], s.eps[0]), qkv_w, qkv_b)
        q, k, v = (t.view(b, -1, head_dim) for t in qkv.split(
            [s.heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        kv_cache, mask = caches[0], window[0]
        if kernel:  # q [B, h, D], k / v [B, h_kv, D] as projected (views of qkv)
            _, lo, pos = window
            attn = gqa_decode_attention(q, k, v, kv_cache, slots, lo, pos, mask.shape[1],
                                        s.scale, qn_w, kn_w, s.eps[2], cos, sin)
            return _layer_tail(s, h, attn.view(b, -1), o_w, norms[1], (), router, entry,
                               gemv_residual if projected else None)
        q, k = q[:, None], k[:, None]  # [B, 1, heads, D]
        if qn_w is not None and kn_w is not None:
            q, k = fused.rms_norm(q, qn_w, s.eps[2]), fused.rms_norm(k, kn_w, s.eps[2])
        q = fused.rotate(q.transpose(1, 2), cos, sin, s.rope)[:, :, 0]  # [B, h, D]
        k = fused.rotate(k.transpose(1, 2), cos, sin, s.rope)[:, :, 0]  # [B, h_kv, D]
        attn = fused.gqa_decode_attention(q, k, v, kv_cache[:, :, 0], kv_cache[:, :, 1],
                                          slots, mask, s.scale)
        new = (torch.stack((k, v), dim=1).to(kv_cache.dtype),)  # [B, 2, h_kv, D]
        return _layer_tail(s, h, attn, o_w, norms[1], new, router)

    return layer


def make_mla_layer(s: LayerStatics) -> Callable[..., tuple[Any, ...]]:
    """The pure layer function of an MLA layer (DeepSeek-V2/V3 with q_proj)."""
    nope, rope_dim, v_dim, rank = s.dims

    def layer(h: torch.Tensor, terms: tuple[torch.Tensor, ...], norms: tuple[torch.Tensor, ...],
              weights: tuple[torch.Tensor | None, ...], cos: torch.Tensor, sin: torch.Tensor,
              caches: tuple[torch.Tensor, ...], slots: torch.Tensor,
              window: tuple[torch.Tensor, ...],
              router: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        q_w, kv_a_w, kv_ln_w, w_k, w_v, o_w = weights
        assert q_w is not None and kv_a_w is not None and kv_ln_w is not None
        assert w_k is not None and w_v is not None and o_w is not None
        b = h.shape[0]
        h = fused.residual(h, terms)
        xn = fused.rms_norm(h, norms[0], s.eps[0])
        q = fused.linear(xn, q_w, None).view(b, s.heads, 1, nope + rope_dim)
        q_pass, q_rot = q.split([nope, rope_dim], dim=-1)
        latent, k_rot = fused.linear(xn, kv_a_w, None).split([rank, rope_dim], dim=-1)
        latent = fused.rms_norm(latent, kv_ln_w, s.eps[2])  # [B, r]
        q_rot = fused.rotate(q_rot, cos, sin, s.rope)[:, :, 0]  # [B, h, d]
        k_rot = fused.rotate(k_rot[:, None, None], cos, sin, s.rope)[:, 0, 0]  # [B, d]
        q_latent = torch.einsum("bhn,hnr->bhr", q_pass[:, :, 0], w_k)  # [B, h, r]
        out = fused.mla_decode_attention(q_latent, q_rot, latent, k_rot, caches[0], caches[1],
                                         slots, window[0], s.scale)
        out = torch.einsum("bhr,hvr->bhv", out, w_v).reshape(b, s.heads * v_dim)
        new = (latent.to(caches[0].dtype), k_rot.to(caches[1].dtype))
        return _layer_tail(s, h, out, o_w, norms[1], new, router)

    return layer


def shared_mlp(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
               gate: torch.Tensor | None) -> torch.Tensor:
    """A dense or shared gated MLP; Qwen2-MoE's shared expert also has a sigmoid gate."""
    out = fused.swiglu(x, *weights)
    if gate is not None:
        out = torch.sigmoid(fused.linear(x, gate, None)) * out
    return out


def final_norm(h: torch.Tensor, terms: tuple[torch.Tensor, ...], weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    """The last layer's residual add and the model's final norm."""
    return fused.rms_norm(fused.residual(h, terms), weight, eps)


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
        self.tickets: list[torch.Tensor] = []
        """kernels/moe_router.py's row tickets (`row_tickets`), the last the one in use: every
        one made is kept, as a captured CUDA graph replays the address it was captured with."""
        if compile:
            import torch._dynamo

            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)

    def _fn(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        fn = _FUNCTIONS.get((key, self.compile))
        if fn is None:
            fn = make()
            if self.compile:
                fn = explain_compile_errors(torch.compile(fn, fullgraph=True, dynamic=False))
            _FUNCTIONS[(key, self.compile)] = fn
        return fn

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
