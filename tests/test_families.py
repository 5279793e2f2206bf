"""Every family's baby model through our whole path equals unmodified transformers.

Loading (`load_model`) → injection (shipped rules) → our runner: prefill logits within 1e-4 in
fp32, and 32 greedy tokens identical to a plain greedy loop over the HF model. The injected
model also still works under transformers' own `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from baby import assert_logits_close, reference_greedy, reference_logits, reference_model

from hetmoe import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The quick brown fox jumps over the lazy dog."


@torch.no_grad()
def plain_greedy(model: torch.nn.Module, token_ids: list[int], steps: int) -> list[int]:
    """Argmax of a full forward pass per step: no cache, no `generate`."""
    ids = list(token_ids)
    for _ in range(steps):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids):]


def test_family_equals_transformers(tiny_family: tuple[str, Path]) -> None:
    family, path = tiny_family
    llm = LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)
    layers = llm.model.config.num_hidden_layers
    ops = [r.op for r in llm.injection.replacements]
    attention = "mla_attention" if family.startswith("deepseek") else "static_kv_attention"
    assert ops.count(attention) == layers
    assert ops.count("hybrid_moe") == sum(
        1 for layer in llm.model.model.layers if type(layer.mlp).__name__ == "HybridMoE"
    ) > 0

    ref = reference_model(path)
    prompt = llm.encode(PROMPT)
    assert_logits_close(llm.logits(prompt), reference_logits(ref, prompt), atol=1e-4)

    out = llm.generate(prompt, max_new_tokens=32)
    expected = plain_greedy(ref, prompt, 32)
    n = len(out.token_ids)
    assert out.token_ids == expected[:n], family
    if n < 32:  # stopped at an end-of-sequence token the reference produced too
        assert out.finish_reason == "stop" and expected[n - 1] in llm.eos_token_ids
    else:
        assert out.finish_reason == "length"
    assert out.prompt_tokens == len(prompt)
    # The text is the tokens' text, less a character cut off by the end (dropped, not "�").
    assert out.text == llm.decode(out.token_ids).rstrip("\ufffd")

    # Still a HF model: transformers' own generate (with its cache) gives the same tokens.
    assert reference_greedy(llm.model, prompt, 8) == reference_greedy(ref, prompt, 8)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("mixtral", {"sliding_window": 8}),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ],
)
def test_sliding_window_equals_transformers(family: str, options: dict, tiny_dir) -> None:
    """A window shorter than the prompt, on every layer (Mixtral) or every other (Qwen2-MoE)."""
    path = tiny_dir(family, **options)
    llm = LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)
    windows = [layer.self_attn.sliding_window for layer in llm.model.model.layers]
    assert windows == ([8, 8] if family == "mixtral" else [8, None])
    ids = list(range(40, 70))
    expected = reference_logits(reference_model(path), ids)  # [30, V]
    assert_logits_close(llm.logits(ids), expected, atol=1e-4)
    runner = llm.runner
    slot = runner.cache.allocate()
    runner.prefill(slot, ids[:20])
    steps = torch.stack([runner.decode([slot], [t])[0] for t in ids[20:]])
    runner.cache.free(slot)
    assert_logits_close(steps, expected[20:], atol=1e-4)
