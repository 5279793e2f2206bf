"""`FusedDecoder`: a decode step as one compiled function per decoder layer (GPU floor cut).

The module path runs each HF decoder layer unchanged: ~73 GPU kernels per layer at batch 1
(norms, projections, q/k norms, rope, cache writes, the mask, attention, router, three input
copies). Here a layer is ONE pure function of tensors (ops/fused.py), from the residual add of
the previous layer's MoE output to the packed router output:

    h += previous MoE terms -> RMSNorm -> q/k/v (one GEMV) -> q/k norm -> rope -> attention over
    the cache plus the new token -> o_proj -> h += attn -> RMSNorm -> router -> pack(x, ids, w)

then, outside it: the CPU experts' start (one copy, engine/overlap.py `forward_packed`), the
cache write (one kernel, off the CPU's critical path), the shared experts, the wait. On a GPU the
layer functions go through `torch.compile` (Inductor); the weights are arguments, so every layer
of a model shares one compiled graph. Attention reads the first `kv_len` cache entries (the
runner's window bucket, ops/kv_batch.py) in chunks of 64 whose count is a dynamic dimension, so
every bucket shares that graph too. Without compile (CPU) the same functions run eagerly.

`plan_layers` says whether a model fits (GQA or MLA attention, RMSNorms, gated SiLU MLPs or
`HybridMoE`); `HybridRunner` uses the module path otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetmoe.engine.overlap import MoEOverlap
from hetmoe.ops import fused
from hetmoe.ops.attention import StaticKVAttention
from hetmoe.ops.kv_batch import KVBatch
from hetmoe.ops.mla import MLAttention
from hetmoe.ops.moe import HybridMoE
from hetmoe.ops.router import RouterConfig, route

RECOMPILE_LIMIT = 64
"""Compiled variants allowed per layer function (batch sizes x layer kinds x MoE terms; the
attention window is a dynamic dimension, not a variant)."""

_FUNCTIONS: dict[Any, Callable[..., Any]] = {}
"""Layer functions by (statics or name, compiled), shared by every `FusedDecoder` of the process
(another runner on the same model shapes reuses the compiled code instead of compiling again)."""


@dataclass(frozen=True)
class LayerStatics:
    """What a layer's compiled graph bakes in (equal for every layer of a model's kind)."""

    attention: str
    """`gqa` or `mla`."""
    eps: tuple[float, float, float]
    """Input norm, post-attention norm and q/k (or latent) norm epsilons."""
    heads: int
    """Query heads."""
    dims: tuple[int, ...]
    """gqa: (kv heads, head dim); mla: (nope, rope, v, kv_lora_rank)."""
    scale: float
    """Softmax scale."""
    rope: str
    """Rope form: `half`, `interleave` or `pairs` (ops/fused.py `rotate`)."""
    router: RouterConfig | None
    """The MoE router's semantics (None: a dense MLP layer)."""
    deferred: int
    """Experts deferred to the next MoE layer (0 for the last one)."""


def _eps(norm: nn.Module | None) -> float:
    """An RMSNorm's epsilon (`variance_epsilon` in HF, `eps` in torch)."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", None)
    if not isinstance(eps, float):
        raise ValueError(f"fused decode needs RMSNorms with an epsilon, found {norm!r}")
    return eps


def _weight(module: nn.Module | None) -> torch.Tensor:
    """A norm's (or linear's) weight, detached; ValueError when it has none."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"fused decode needs a weight on {module!r}")
    return weight.detach()


def _plain(module: object) -> torch.Tensor:
    """The weight of a bias-free linear; ValueError otherwise."""
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise ValueError(f"fused decode needs bias-free linears, found {module!r}")
    return module.weight.detach()


class LayerPlan:
    """One decoder layer's weights and caches as the tensors the layer function takes."""

    def __init__(self, layer: Any, act: str) -> None:
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
            if getattr(layer, name, None) is None:
                raise ValueError(f"fused decode needs a decoder layer with `{name}`")
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn
        self.norms = (_weight(layer.input_layernorm), _weight(layer.post_attention_layernorm))
        self.moe: HybridMoE | None = mlp if isinstance(mlp, HybridMoE) else None
        self.window: int | None = None
        if isinstance(attn, StaticKVAttention):
            self.window = attn.sliding_window
            qkv, bias = attn.fused_qkv()
            q_norm = k_norm = None
            qk_eps = 0.0
            if attn.q_norm is not None and attn.k_norm is not None:
                q_norm, k_norm = _weight(attn.q_norm), _weight(attn.k_norm)
                qk_eps = _eps(attn.q_norm)
            self.weights: tuple[torch.Tensor | None, ...] = (
                qkv, bias, q_norm, k_norm, _plain(attn.o_proj))
            dims: tuple[int, ...] = (attn.num_kv_heads, attn.head_dim)
            heads = (qkv.shape[0] - 2 * attn.num_kv_heads * attn.head_dim) // attn.head_dim
            kind, rope = "gqa", "half"
        elif isinstance(attn, MLAttention):
            kv_b = attn._plain_kv_b_weight()
            if kv_b is None or attn.q_proj is None:
                raise ValueError("fused decode needs MLA with q_proj and a plain kv_b_proj")
            w = kv_b.detach().view(attn.num_heads, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
            w_k, w_v = w.split([attn.nope_dim, attn.v_dim], dim=1)
            self.weights = (_plain(attn.q_proj), _plain(attn.kv_a_proj_with_mqa),
                            _weight(attn.kv_a_layernorm), w_k, w_v, _plain(attn.o_proj))
            qk_eps = _eps(attn.kv_a_layernorm)
            dims = (attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank)
            heads, kind = attn.num_heads, "mla"
            rope = "interleave" if attn.interleave else "pairs"
        else:
            raise ValueError(f"fused decode has no form for {type(attn).__name__}")
        if act != "silu":
            raise ValueError(f"fused decode needs SiLU MLPs, found hidden_act={act!r}")
        self.dense: tuple[torch.Tensor, ...] | None = None
        self.shared: tuple[torch.Tensor, ...] | None = None
        self.shared_gate: torch.Tensor | None = None
        router = None
        if self.moe is not None:
            router = self.moe.gate.config
            self.router = (self.moe.gate.weight.detach(),
                           self.moe.gate.e_score_correction_bias if router.has_bias else None)
            shared = self.moe.shared_experts or self.moe.shared_expert
            if shared is not None:
                self.shared = _mlp(shared)
            if self.moe.shared_expert_gate is not None:
                self.shared_gate = _plain(self.moe.shared_expert_gate)
        else:
            self.dense = _mlp(mlp)
        self.statics = LayerStatics(
            kind, (_eps(layer.input_layernorm), _eps(layer.post_attention_layernorm), qk_eps),
            heads, dims, float(attn.scaling), rope, router, 0)

    def caches(self) -> tuple[torch.Tensor, ...]:
        """The layer's cache tensors (allocated by the runner's cache after this plan)."""
        if isinstance(self.attn, StaticKVAttention):
            assert self.attn.kv_cache is not None
            return (self.attn.kv_cache,)
        assert self.attn.latent_cache is not None and self.attn.rope_cache is not None
        return (self.attn.latent_cache, self.attn.rope_cache)


def _mlp(module: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(_plain(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj"))


def plan_layers(model: Any) -> list[LayerPlan]:
    """Every decoder layer's plan; ValueError naming the first layer the fused path cannot run."""
    base = getattr(model, model.base_model_prefix)
    act = str(getattr(model.config, "hidden_act", "silu"))
    plans = []
    for i, layer in enumerate(base.layers):
        try:
            plans.append(LayerPlan(layer, act))
        except ValueError as exc:
            raise ValueError(f"decoder layer {i}: {exc}") from exc
    return plans


def _residual(h: torch.Tensor, terms: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h + the previous MLP's terms, rounded as the module path rounds them (each term to h's
    dtype, summed, then added to the residual)."""
    if not terms:
        return h
    out = terms[0].to(h.dtype)
    for t in terms[1:]:
        out = out + t.to(h.dtype)
    return h + out


def _layer_tail(s: LayerStatics, h: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor,
                post_norm: torch.Tensor, new: tuple[torch.Tensor, ...],
                router: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    """Every layer function's end: o_proj + residual, the post-attention norm, and on MoE layers
    the router with the CPU experts' packed inputs. Returns (h, x, new cache entries, stage or
    None, deferred ids or None)."""
    h = h + fused.linear(attn, o_w, None)
    x = fused.rms_norm(h, post_norm, s.eps[1])
    if s.router is None:
        return h, x, new, None, None
    router_w, router_b = router
    assert router_w is not None
    ids, weights = route(x, router_w, router_b, s.router, fused=True)
    if not s.deferred:
        return h, x, new, fused.pack_moe_inputs(x, ids, weights), None
    k = ids.shape[1] - s.deferred
    late = torch.cat((torch.full_like(ids[:, :k], -1), ids[:, k:]), dim=1)
    immediate = torch.cat((ids[:, :k], torch.full_like(ids[:, k:], -1)), dim=1)
    return h, x, new, fused.pack_moe_inputs(x, immediate, weights), late


def make_gqa_layer(s: LayerStatics) -> Callable[..., tuple[Any, ...]]:
    """The pure layer function of a GQA layer with statics `s` (see the module docstring)."""
    kv_heads, head_dim = s.dims

    def layer(h: torch.Tensor, terms: tuple[torch.Tensor, ...], norms: tuple[torch.Tensor, ...],
              weights: tuple[torch.Tensor | None, ...], cos: torch.Tensor, sin: torch.Tensor,
              caches: tuple[torch.Tensor, ...], slots: torch.Tensor, mask: torch.Tensor,
              router: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        qkv_w, qkv_b, qn_w, kn_w, o_w = weights
        assert qkv_w is not None and o_w is not None
        b = h.shape[0]
        h = _residual(h, terms)  # [B, H]
        qkv = fused.linear(fused.rms_norm(h, norms[0], s.eps[0]), qkv_w, qkv_b)
        q, k, v = qkv.split([s.heads * head_dim, kv_heads * head_dim,
                             kv_heads * head_dim], dim=-1)
        q, k = q.view(b, 1, s.heads, head_dim), k.view(b, 1, kv_heads, head_dim)
        if qn_w is not None and kn_w is not None:
            q, k = fused.rms_norm(q, qn_w, s.eps[2]), fused.rms_norm(k, kn_w, s.eps[2])
        q = fused.rotate(q.transpose(1, 2), cos, sin, s.rope)[:, :, 0]  # [B, h, D]
        k = fused.rotate(k.transpose(1, 2), cos, sin, s.rope)[:, :, 0]  # [B, h_kv, D]
        v = v.view(b, kv_heads, head_dim)
        kv_cache = caches[0]
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
              caches: tuple[torch.Tensor, ...], slots: torch.Tensor, mask: torch.Tensor,
              router: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        q_w, kv_a_w, kv_ln_w, w_k, w_v, o_w = weights
        assert q_w is not None and kv_a_w is not None and kv_ln_w is not None
        assert w_k is not None and w_v is not None and o_w is not None
        b = h.shape[0]
        h = _residual(h, terms)
        xn = fused.rms_norm(h, norms[0], s.eps[0])
        q = fused.linear(xn, q_w, None).view(b, s.heads, 1, nope + rope_dim)
        q_pass, q_rot = q.split([nope, rope_dim], dim=-1)
        latent, k_rot = fused.linear(xn, kv_a_w, None).split([rank, rope_dim], dim=-1)
        latent = fused.rms_norm(latent, kv_ln_w, s.eps[2])  # [B, r]
        q_rot = fused.rotate(q_rot, cos, sin, s.rope)[:, :, 0]  # [B, h, d]
        k_rot = fused.rotate(k_rot[:, None, None], cos, sin, s.rope)[:, 0, 0]  # [B, d]
        q_latent = torch.einsum("bhn,hnr->bhr", q_pass[:, :, 0], w_k)  # [B, h, r]
        out = fused.mla_decode_attention(q_latent, q_rot, latent, k_rot, caches[0], caches[1],
                                         slots, mask, s.scale)
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
    return fused.rms_norm(_residual(h, terms), weight, eps)


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

    def __init__(self, model: Any, overlap: MoEOverlap, compile: bool) -> None:
        """`compile`: run the layer functions through torch.compile (GPU), else eagerly."""
        self.base = getattr(model, model.base_model_prefix)
        self.plans = plan_layers(model)
        self.overlap = overlap
        self.moe_index = {id(m): i for i, m in enumerate(overlap.layers)}
        self.compile = compile
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
        maker = make_gqa_layer if statics.attention == "gqa" else make_mla_layer
        return self._fn(statics, lambda: maker(statics))

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
        masks: dict[int | None, torch.Tensor] = {}
        terms: tuple[torch.Tensor, ...] = ()
        overlap = self.overlap
        for n, plan in enumerate(self.plans):
            if before_layer is not None:
                before_layer(n)
            window = plan.window
            caches = plan.caches()
            if window not in masks:
                masks[window] = self._mask(pos, kv.kv_len, window)
            statics = plan.statics
            if plan.moe is not None:
                i = self.moe_index[id(plan.moe)]
                # The layer function splits the ids only when the CPU job does not.
                d = 0 if overlap.chains_deferral() else overlap.deferred_at(i)
                statics = dataclasses.replace(statics, deferred=d)
            router = plan.router if plan.moe is not None else (None, None)
            h, x, new, stage, late = self._layer_fn(statics)(
                h, terms, plan.norms, plan.weights, cos, sin, caches, kv.slots, masks[window],
                router)
            if plan.moe is None:
                self._write(caches, new, kv.slots, pos)
                assert plan.dense is not None
                dense = plan.dense
                terms = (self._fn("mlp", lambda: shared_mlp)(x, dense, None),)
                continue
            between = functools.partial(self._between, plan, x, caches, new, kv.slots, pos)
            terms = tuple(overlap.forward_packed(i, x, stage, late, between))
        norm = self.base.norm
        out = self._fn("final", lambda: final_norm)(h, terms, norm.weight.detach(), _eps(norm))
        return out.view(b, 1, -1)

    def _mask(self, pos: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
        """`fused.window_mask` over the first `width` cache entries; compiled, its chunk count
        is marked dynamic, so every window bucket shares one compiled graph."""
        allowed = fused.window_mask(pos, width, window)  # [B, n, c]
        if self.compile:
            from torch._dynamo import mark_dynamic

            mark_dynamic(allowed, 1)
        return allowed

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
        """Stores the step's new cache entries (one kernel per cache tensor)."""
        for cache, entry in zip(caches, new, strict=True):
            cache.index_put_((slots, pos), entry)
