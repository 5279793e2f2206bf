"""The one checker for baby models: unmodified transformers on the same directory is the oracle.

Import from any test (`from baby import ...`); the helpers compare our results with what
`AutoModelForCausalLM.from_pretrained` computes on the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Unmodified transformers on `path`, eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@torch.no_grad()
def reference_logits(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Prefill logits [T, V] float32 of the reference model."""
    ids = torch.tensor([token_ids])
    return model(input_ids=ids).logits[0].float()


@torch.no_grad()
def reference_greedy(model: nn.Module, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation (new tokens only) of the reference model, never stopping early."""
    ids = torch.tensor([token_ids])
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(token_ids):].tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4) -> None:
    """Same shape and max |Δ| ≤ atol; the message gives the worst position and both values."""
    assert ours.shape == ref.shape, f"logits shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs()
    worst = int(diff.argmax())
    pos, tok = divmod(worst, ref.shape[-1])
    assert diff.max() <= atol, (
        f"max |Δlogits| = {diff.max():.3g} > {atol} at position {pos}, token {tok}: "
        f"ours {ours.flatten()[worst]:.6f}, reference {ref.flatten()[worst]:.6f}"
    )


def assert_same_state(ours: nn.Module, ref: nn.Module, atol: float = 0.0) -> None:
    """Every parameter and buffer of `ref` (computed ones like rotary `inv_freq` included) exists
    in `ours` with equal shape, dtype and values (|Δ| ≤ atol)."""
    mine = {**dict(ours.named_buffers()), **ours.state_dict()}
    expected_state = {**dict(ref.named_buffers()), **ref.state_dict()}
    for name, expected in expected_state.items():
        assert name in mine, f"{name} missing from our model"
        got = mine[name]
        assert got.device.type != "meta", f"{name} left on the meta device"
        shapes = f"{tuple(got.shape)} != {tuple(expected.shape)}"
        assert got.shape == expected.shape, f"{name}: shape {shapes}"
        assert got.dtype == expected.dtype, f"{name}: dtype {got.dtype} != {expected.dtype}"
        delta = (got.float().cpu() - expected.float()).abs().max().item() if got.numel() else 0.0
        assert delta <= atol, f"{name}: max |Δ| = {delta:.3g} > {atol}"
