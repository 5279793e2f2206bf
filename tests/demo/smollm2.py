"""Helpers of the demo tests (fixtures live in conftest.py): prompts and the reference side."""

from __future__ import annotations

from pathlib import Path

import torch
from baby import assert_logits_close, reference_logits
from torch import nn

from hetmoe.engine.engine import LLM

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


def fp32_llm(path: Path) -> LLM:
    """Our engine on `path` with exact arithmetic: fp32 on the CPU device, torch experts."""
    return LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)


def assert_same_as_dense(llm: LLM, dense: nn.Module) -> None:
    """Our prefill logits of the chat question equal the dense model's, max |Δ| <= 1e-3."""
    ids = chat_ids(llm.path, QUESTION)
    assert_logits_close(llm.logits(ids), reference_logits(dense, ids), atol=1e-3)


def assert_same_greedy_as_dense(llm: LLM, dense: nn.Module, tokens: int) -> None:
    """Our greedy decode of the story prompt gives the dense model's `tokens` tokens."""
    ids = chat_ids(llm.path, STORY)
    ours = llm.generate(ids, max_new_tokens=tokens).token_ids
    ref = greedy_until_eos(dense, ids, tokens, eos=2)
    assert ours == ref, f"ours {llm.decode(ours)!r}, dense {llm.decode(ref)!r}"
    assert len(ours) == tokens  # a real continuation, not an early stop
