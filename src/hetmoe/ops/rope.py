"""Rotary embedding applied with HF's own rotary output, so every scaling type (yarn, ...) holds.

HF families hand over `position_embeddings` as `(cos, sin)` [B, S, D] (rotate-half layout, or
interleaved pairs when `rope_interleave`), except DeepSeek-V2, whose rotary module returns complex
`freqs_cis` [B, S, D/2] for interleaved pairs.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


RotaryEmbedding = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What HF rotary modules return: complex `freqs_cis`, or `(cos, sin)`."""


def apply_rope(
    x: torch.Tensor, position_embeddings: RotaryEmbedding, interleave: bool = False
) -> torch.Tensor:
    """Rotates x [B, heads, S, D] by the positions `position_embeddings` was computed for."""
    if isinstance(position_embeddings, torch.Tensor):  # complex freqs_cis, interleaved pairs
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = pairs * position_embeddings.unsqueeze(1).to(x.device)
        return torch.view_as_real(rotated).flatten(3).type_as(x)
    cos, sin = position_embeddings  # [B, S, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
