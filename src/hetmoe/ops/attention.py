"""`static_kv_attention`: GQA/MHA over our static KV cache (Qwen2/3-MoE, Mixtral).

Keeps the HF projections as children (`q_proj`, `k_proj`, `v_proj`, `o_proj`, Qwen3's `q_norm` /
`k_norm`, run as ops/norm.py `apply_norm`; Qwen2's biases live inside the projections). Called by
the runner's decoder layer (ops/decoder_layer.py) with `kv=KVBatch`: it reads and writes our cache;
without it (HF's decoder layer in HF's own forward or `generate`) it uses the HF `Cache` HF passes,
if any, and HF's mask, so the model stays usable as a HF module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.inject.registry import OpContext, register_op
from hetmoe.ops.kv_batch import KVBatch, RaggedKV
from hetmoe.ops.norm import apply_norm
from hetmoe.ops.rope import apply_rope


@dataclass(frozen=True)
class AttentionOptions:
    """Rule kwargs of the attention ops (none yet)."""


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, h, S, D], k/v [B, h_kv, L, D*] -> [B, S, h, Dv]; h_kv divides h (GQA)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    causal = mask is None and q.shape[2] > 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def hf_mask(attention_mask: object) -> torch.Tensor | None:
    """The 4-D mask HF's model forward built (used only without a KVBatch)."""
    return attention_mask if isinstance(attention_mask, torch.Tensor) else None


# The keyword under which HF's decoder layer hands its `Cache` to attention: `cache` from
# transformers 5.24, `past_key_values` before. Both are read, so one release's rename does not
# make HF's `generate` run without a cache.
HF_CACHE_KEYWORDS = ("cache", "past_key_values")


def hf_cache(kwargs: dict[str, object]) -> Any:
    """HF's `Cache` object among an attention call's keyword arguments, or None."""
    for name in HF_CACHE_KEYWORDS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


class StaticKVAttention(nn.Module):
    """Multi-head / grouped-query attention with rope, on a multi-slot static KV cache."""

    def __init__(self, hf: Any, device: torch.device, window: int | None) -> None:
        super().__init__()
        self.device = device
        self.layer_idx = hf.layer_idx
        self.head_dim: int = hf.head_dim
        self.scaling: float = hf.scaling
        self.sliding_window = window
        self.q_proj: nn.Module = hf.q_proj
        self.k_proj: nn.Module = hf.k_proj
        self.v_proj: nn.Module = hf.v_proj
        self.o_proj: nn.Module = hf.o_proj
        self.q_norm: nn.Module | None = getattr(hf, "q_norm", None)
        self.k_norm: nn.Module | None = getattr(hf, "k_norm", None)
        self.num_kv_heads: int = hf.k_proj.out_features // hf.head_dim
        self._qkv: torch.Tensor | None = None  # q/k/v weights as one tensor (fused_qkv)
        self.kv_cache: torch.Tensor | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate_kv(self, max_batch: int, max_len: int, dtype: torch.dtype) -> int:
        """Creates this layer's cache [max_batch, max_len, 2, h_kv, D] (K and V side by side,
        so a decode step writes both in one kernel; `k_cache` / `v_cache` are its views
        [max_batch, max_len, h_kv, D]); returns its bytes."""
        shape = (max_batch, max_len, 2, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, device=self.device, dtype=dtype)
        self.k_cache, self.v_cache = self.kv_cache[:, :, 0], self.kv_cache[:, :, 1]
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def kv_tensors(self) -> tuple[torch.Tensor, ...]:
        """This layer's caches, slot first (for copying a slot's tokens)."""
        if self.kv_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx} has no cache (allocate_kv)")
        return (self.kv_cache,)

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [(h + 2 h_kv) D, H], bias or None) of q/k/v as one projection (one GEMV per
        decode step). The first call moves the three weights into one tensor and leaves the
        projections holding views of it, so no memory is duplicated."""
        projections = [p for p in (self.q_proj, self.k_proj, self.v_proj)
                       if isinstance(p, nn.Linear)]
        if len(projections) != 3:
            raise ValueError(f"attention layer {self.layer_idx}: q/k/v must be nn.Linear")
        fused = self._qkv
        offsets = [0, projections[0].out_features]
        offsets.append(offsets[1] + projections[1].out_features)
        if fused is None or any(p.weight.data_ptr() != fused[o].data_ptr()
                                for p, o in zip(projections, offsets, strict=True)):
            fused = torch.cat([p.weight.detach() for p in projections])
            for proj, start in zip(projections, offsets, strict=True):
                rows = proj.out_features
                proj.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            self._qkv = fused
        biases = [p.bias for p in projections]
        bias = None
        if all(b is not None for b in biases):
            bias = torch.cat([b.detach() for b in biases if b is not None])
        return fused, bias

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: object = None,
        kv: KVBatch | RaggedKV | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [B, S, H] -> ([B, S, H], None), the HF attention return shape; with a
        `RaggedKV`, [1, T, H] attended part by part."""
        if isinstance(kv, RaggedKV):
            return kv.split_call(lambda x, r, part: self.forward(x, r, kv=part)[0],
                                 hidden_states, position_embeddings), None
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim)  # [B, S, h, D]
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim)  # [B, S, h_kv, D]
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = apply_norm(self.q_norm, q), apply_norm(self.k_norm, k)
        q = apply_rope(q.transpose(1, 2), position_embeddings)  # [B, h, S, D]
        k = apply_rope(k.transpose(1, 2), position_embeddings)  # [B, h_kv, S, D]
        if kv is None:
            v = v.transpose(1, 2)  # [B, h_kv, S, D]
            past = hf_cache(kwargs)
            if past is not None:  # HF's cache, when HF code drives the model
                k, v = past.update(k, v, self.layer_idx)
            out = attend(q, k, v, self.scaling, hf_mask(attention_mask))
        else:
            if self.k_cache is None or self.v_cache is None:
                raise RuntimeError(f"attention layer {self.layer_idx}: KV cache not allocated")
            keys = kv.write(self.k_cache, k.transpose(1, 2)).transpose(1, 2)  # [B, h_kv, L, D]
            values = kv.write(self.v_cache, v).transpose(1, 2)
            out = attend(q, keys, values, self.scaling, kv.mask_or_causal(self.sliding_window))
        return self.o_proj(out.reshape(b, s, -1)), None


@register_op("static_kv_attention", AttentionOptions)
def build_static_kv_attention(
    module: nn.Module, device: torch.device, options: AttentionOptions, ctx: OpContext
) -> StaticKVAttention:
    """Replaces a HF GQA/MHA attention module (Qwen2-MoE, Qwen3-MoE, Mixtral)."""
    for child in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(module, child, None), nn.Linear):
            raise ValueError(f"static_kv_attention needs a `{child}` linear (MLA: mla_attention)")
    # Mixtral reads the window from the config; Qwen sets it per layer on the module.
    window = getattr(module, "sliding_window", None)
    if ctx.config.model_type == "mixtral":
        window = getattr(ctx.config, "sliding_window", None)
    return StaticKVAttention(module, device, window or None)
