"""Greedy decode on a runner with every step's logits, and the check that two such runs agree,
shared by the hybrid runtime's tests."""

from __future__ import annotations

import torch
from deferral_reference import DeferralReference

from hetmoe.engine.executor.runner import ModelRunner

PROMPT = [5, 9, 33, 100, 7]
"""Prompt token ids (inside the baby vocabulary)."""

SAME_BACKEND_ATOL = 1e-2
"""Two decode paths over the same C++ expert backend on fp32 baby models, differing only in the
order of float additions. The backend rounds each expert input to bf16, so one fp32 ulp of
difference can flip one element's bf16 rounding (2**-8 relative), which reaches that step's
logits at up to ~7e-3 (seen on an AMD EPYC host at single deepseek_v2 steps; ~2e-5 at the others,
1e-6 on the Intel hosts before). Real errors (a wrong expert, window or deferral) move the logits
by 0.1 or more, and tokens must match exactly."""


Greedy = tuple[list[int], list[torch.Tensor]]
"""`greedy`'s tokens and logits per step."""


def greedy(runner: ModelRunner, steps: int, reference: DeferralReference | None = None,
           ) -> Greedy:
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


def assert_same_greedy(ours: Greedy, ref: Greedy, label: str) -> None:
    """The same tokens, and every step's logits within SAME_BACKEND_ATOL of the reference's."""
    assert ours[0] == ref[0], f"{label}: tokens {ours[0]} != {ref[0]}"
    for step, (a, b) in enumerate(zip(ours[1], ref[1], strict=True)):
        delta = (a - b).abs().max().item()
        assert delta <= SAME_BACKEND_ATOL, f"{label} step {step}: |Δlogits| {delta:.3g}"
