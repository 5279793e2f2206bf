"""The fused decode step's layer functions: one pure function of tensors per decoder layer.

The module path runs each HF decoder layer's modules (ops/decoder_layer.py): ~73 GPU kernels per
layer at batch 1 (norms, projections, q/k norms, rope, cache writes, the mask, attention, router,
three input copies). Here a layer is ONE pure function of tensors (ops/fused.py), from the
residual add of the previous layer's MoE output to the packed router output:

    h += previous MoE terms -> RMSNorm -> q/k/v (one GEMV) -> q/k norm -> rope -> attention over
    the cache plus the new token -> o_proj -> h += attn -> RMSNorm -> router -> pack(x, ids, w)

On a GPU (HETMOE_DECODE_KERNELS, env.decode_kernels: triton by default) q/k norms, rope and GQA
attention are kernels/gqa_decode.py, which stores the new cache entries itself, and the MoE
layer's residual, norm, router and pack kernels/moe_router.py (one launch over the decoder's row
tickets), and for batches of up to `kernels.gemv_config.DECODE_GEMV_MAX_ROWS` bf16 rows the input
norm with q/k/v kernels/norm_gemv.py and o_proj kernels/gemv_residual.py (larger batches:
cuBLAS), inside the compiled graph (`triton_op`s). Also here: the dense or shared MLP and the
final norm. `FusedDecoder` (engine/executor/fused_decode.py) compiles and runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetmoe.engine.executor.layer_plan import LayerStatics
from hetmoe.ops import fused
from hetmoe.ops.router import route

# The Triton kernels are imported inside `make_gqa_layer`, where they run: kernels/ loads Triton,
# absent from CPU-only installs, and an uncompiled runner on the CPU loads none of them.


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
