"""Helpers of the demo tests (fixtures live in conftest.py): prompts and the reference side."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write two sentences about a cat who likes rain."}]


def chat_ids(path: Path, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` under the checkpoint's own tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def greedy_until_eos(model: nn.Module, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy new tokens of a transformers model, up to and including the first `eos`."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, len(ids):].tolist()
