"""Batched greedy decode: prompts in their own KV slots decoded together, each step's logits
kept; shared by the engine's and the kernels' decode tests (`from decode_rows import ...`)."""

from __future__ import annotations

import torch

from hetmoe.engine.executor.runner import ModelRunner


def greedy_rows(runner: ModelRunner, prompts: list[list[int]], steps: int,
                ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt prefilled into a newly allocated slot, then `steps` greedy decode steps of all
    rows together -> (tokens per row: prefill's then each step's, [B, V] fp32 CPU logits per
    step)."""
    slots = [runner.cache.allocate() for _ in prompts]
    tokens = [[int(runner.prefill(s, p).argmax())] for s, p in zip(slots, prompts, strict=True)]
    logits = []
    for _ in range(steps):
        out = runner.decode(slots, [t[-1] for t in tokens])  # [B, V]
        logits.append(out.float().cpu())
        for row, t in zip(out.argmax(-1).tolist(), tokens, strict=True):
            t.append(row)
    return tokens, logits
