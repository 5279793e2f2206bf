"""The sampling penalties as specified, in float64 (the oracle of the sampler's tests)."""

from __future__ import annotations

import torch


def penalized_reference(logits: list[float], prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> torch.Tensor:
    """The penalties as specified, in float64: repetition over prompt + output (divide a
    positive logit, multiply a negative one), then frequency x count and presence once per
    generated token."""
    out = [float(x) for x in logits]
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return torch.tensor(out, dtype=torch.float64)
