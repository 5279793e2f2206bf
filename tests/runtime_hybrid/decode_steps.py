"""Greedy decode on a runner with every step's logits, shared by the hybrid runtime's tests."""

from __future__ import annotations

import torch

from hetmoe.engine.runner import ModelRunner
from hetmoe.ops.deferral import DeferralReference

PROMPT = [5, 9, 33, 100, 7]
"""Prompt token ids (inside the baby vocabulary)."""


def greedy(runner: ModelRunner, steps: int, reference: DeferralReference | None = None,
           ) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill PROMPT into slot 0, then `steps` greedy decode steps; frees nothing (fresh slot).
    `reference`, when given, is installed during decode only, as prefill never defers."""
    runner.lengths[0] = 0
    logits = [runner.prefill(0, PROMPT)]
    tokens = [int(logits[0].argmax())]
    for _ in range(steps):
        if reference is None:
            out = runner.decode([0], [tokens[-1]])
        else:
            with reference.decoding():
                out = runner.decode([0], [tokens[-1]])
        logits.append(out[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits
