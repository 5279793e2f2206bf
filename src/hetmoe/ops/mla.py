"""`mla_attention`: DeepSeek-V2/V3 multi-head latent attention over our static KV cache.

The cache holds what MLA makes small: the normalized latent `c_kv` [kv_lora_rank] and the shared
rotated key `k_rot` [qk_rope_head_dim] per token. Prefill expands the latents with `kv_b_proj`
into per-head keys and values (as HF does); decode folds `kv_b_proj` into the query and the output
and attends in latent space, so a step costs O(L·h·(r+d)) instead of expanding all L latents.
HF child names are kept (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`); the softmax scale comes from HF (yarn mscale included),
rope from HF's rotary output. Without a `KVBatch` (HF's forward or `generate`) the latents go to
the HF `Cache` HF passes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetmoe.inject.registry import OpContext, register_op
from hetmoe.ops.attention import AttentionOptions, attend, hf_cache, hf_mask
from hetmoe.ops.fused import absorbed_weights
from hetmoe.ops.kv_batch import KVBatch, RaggedKV
from hetmoe.ops.norm import apply_norm
from hetmoe.ops.rope import apply_rope


class MLAttention(nn.Module):
    """Multi-head latent attention with a latent static KV cache."""

    def __init__(self, hf: Any, device: torch.device, interleave: bool) -> None:
        super().__init__()
        self.device = device
        self.layer_idx = hf.layer_idx
        self.num_heads: int = hf.num_heads
        self.nope_dim: int = hf.qk_nope_head_dim
        self.rope_dim: int = hf.qk_rope_head_dim
        self.v_dim: int = hf.v_head_dim
        self.kv_lora_rank: int = hf.kv_lora_rank
        self.scaling: float = hf.scaling
        self.interleave = interleave
        self.q_proj: nn.Module | None = hf.q_proj
        self.q_a_proj: nn.Module | None = hf.q_a_proj
        self.q_b_proj: nn.Module | None = hf.q_b_proj
        self.q_a_layernorm: nn.Module | None = hf.q_a_layernorm
        self.kv_a_proj_with_mqa: nn.Module = hf.kv_a_proj_with_mqa
        self.kv_a_layernorm: nn.Module = hf.kv_a_layernorm
        self.kv_b_proj: nn.Module = hf.kv_b_proj
        self.o_proj: nn.Module = hf.o_proj
        self.latent_cache: torch.Tensor | None = None
        self.rope_cache: torch.Tensor | None = None

    def allocate_kv(self, max_batch: int, max_len: int, dtype: torch.dtype) -> int:
        """Creates the latent and rope-key caches; returns their bytes."""
        self.latent_cache = torch.zeros(
            max_batch, max_len, self.kv_lora_rank, device=self.device, dtype=dtype
        )
        self.rope_cache = torch.zeros(
            max_batch, max_len, self.rope_dim, device=self.device, dtype=dtype
        )
        per_entry = self.latent_cache.element_size()
        return (self.latent_cache.numel() + self.rope_cache.numel()) * per_entry

    def kv_tensors(self) -> tuple[torch.Tensor, ...]:
        """This layer's caches, slot first (for copying a slot's tokens)."""
        if self.latent_cache is None or self.rope_cache is None:
            raise RuntimeError("an MLA layer has no cache (allocate_kv)")
        return (self.latent_cache, self.rope_cache)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: object = None,
        kv: KVBatch | RaggedKV | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [B, S, H] -> ([B, S, H], None); with a `RaggedKV`, [1, T, H] attended
        part by part."""
        if isinstance(kv, RaggedKV):
            return kv.split_call(lambda x, r, part: self.forward(x, r, kv=part)[0],
                                 hidden_states, position_embeddings), None
        b, s, _ = hidden_states.shape
        if self.q_proj is not None:
            q = self.q_proj(hidden_states)
        else:  # low-rank query (q_lora_rank set): all three exist
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(apply_norm(self.q_a_layernorm, self.q_a_proj(hidden_states)))
        q = q.view(b, s, self.num_heads, -1).transpose(1, 2)  # [B, h, S, nope+rope]
        q_pass, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent = apply_norm(self.kv_a_layernorm, latent)  # [B, S, r]
        q_rot = apply_rope(q_rot, position_embeddings, self.interleave)
        k_rot = apply_rope(k_rot[:, None], position_embeddings, self.interleave)[:, 0]  # [B, S, d]
        mask = hf_mask(attention_mask)
        past = hf_cache(kwargs)
        if kv is None and past is not None:  # HF's cache: [B, 1, L, *] as HF's MLA stores it
            cached = past.update(latent[:, None], k_rot[:, None], self.layer_idx)
            latent, k_rot = cached[0][:, 0], cached[1][:, 0]
        if kv is not None:
            if self.latent_cache is None or self.rope_cache is None:
                raise RuntimeError(f"MLA layer {self.layer_idx}: KV cache not allocated")
            latent = kv.write(self.latent_cache, latent)  # [B, L, r]
            k_rot = kv.write(self.rope_cache, k_rot)  # [B, L, d]
            mask = kv.mask_or_causal()
            weight = self._plain_kv_b_weight()
            if s == 1 and weight is not None:
                out = self._absorbed(q_pass, q_rot, latent, k_rot, kv.mask(), weight)
                return self.o_proj(out.reshape(b, s, -1)), None
        length = latent.shape[1]
        expanded = self.kv_b_proj(latent).view(b, length, self.num_heads, -1).transpose(1, 2)
        k_nope, values = expanded.split([self.nope_dim, self.v_dim], dim=-1)  # [B, h, L, *]
        k_rot = k_rot[:, None].expand(-1, self.num_heads, -1, -1)  # [B, h, L, d]
        keys = torch.cat((k_nope, k_rot), dim=-1)
        query = torch.cat((q_pass, q_rot), dim=-1)
        out = attend(query, keys, values, self.scaling, mask)  # [B, S, h, v]
        return self.o_proj(out.reshape(b, s, -1)), None

    def _plain_kv_b_weight(self) -> torch.Tensor | None:
        """kv_b_proj's weight [h*(nope+v), r] when it is a plain bias-free linear, else None."""
        proj = self.kv_b_proj
        return proj.weight if isinstance(proj, nn.Linear) and proj.bias is None else None

    def _absorbed(
        self,
        q_pass: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        mask: torch.Tensor,
        kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        """Decode attention in latent space: kv_b_proj is folded into the query and the output
        instead of expanding every cached latent (cost O(L·h·(r+d)), not O(L·r·h·(nope+v))).

        q_pass [B, h, S, nope], q_rot [B, h, S, d], latent [B, L, r], k_rot [B, L, d],
        mask [B, 1, S, L], kv_b_weight [h*(nope+v), r] -> [B, S, h, v].
        """
        b, h, s, _ = q_pass.shape
        w_k, w_v = absorbed_weights(kv_b_weight, h, self.nope_dim, self.v_dim)  # [h, nope|v, r]
        q_latent = torch.einsum("bhsn,hnr->bhsr", q_pass, w_k)  # [B, h, S, r]
        query = torch.cat((q_latent, q_rot), dim=-1).reshape(b, h * s, -1)  # heads as rows
        keys = torch.cat((latent, k_rot), dim=-1)  # [B, L, r+d]: one key head shared by all
        scores = (query @ keys.transpose(1, 2)).float() * self.scaling  # [B, h*S, L]
        scores = scores.view(b, h, s, -1).masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1).to(latent.dtype).view(b, h * s, -1)
        out_latent = (probs @ latent).view(b, h, s, -1)  # [B, h, S, r]
        return torch.einsum("bhsr,hvr->bshv", out_latent, w_v)  # [B, S, h, v]


@register_op("mla_attention", AttentionOptions)
def build_mla_attention(
    module: nn.Module, device: torch.device, options: AttentionOptions, ctx: OpContext
) -> MLAttention:
    """Replaces a HF DeepSeek-V2/V3 attention module."""
    if not hasattr(module, "kv_a_proj_with_mqa"):
        raise ValueError("mla_attention replaces DeepSeek MLA attention (needs kv_a_proj_with_mqa)")
    interleave = bool(getattr(ctx.config, "rope_interleave", False))
    return MLAttention(module, device, interleave)
