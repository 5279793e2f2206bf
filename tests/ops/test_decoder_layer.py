"""ops/decoder_layer.py: the module path's layer steps over the fused step's functions equal HF's
own decoder layers (with our attention and MoE modules injected) bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hetmoe import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.decoder_layer import decoder_stack
from hetmoe.ops.kv_batch import KVBatch, RaggedKV
from hetmoe.ops.rope import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("one_torch_thread")
Stack = Callable[[Any, torch.Tensor, RotaryEmbedding, KVBatch | RaggedKV], torch.Tensor]


def hf_layers(base: Any, hidden: torch.Tensor, rotary: RotaryEmbedding,
              kv: KVBatch | RaggedKV) -> torch.Tensor:
    """HF's decoder layers called as modules, then HF's final norm (the module path before)."""
    for layer in base.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=kv.positions,
                       position_embeddings=rotary, kv=kv)
    return base.norm(hidden)


def _passes(runner: ModelRunner, stack: Stack) -> list[torch.Tensor]:
    """A prefill of slot 0, then one pass of a prefill of slot 1 with a decode row of slot 0
    (a `RaggedKV`), through `stack`."""
    base = runner.base

    def run(ids: torch.Tensor, kv: KVBatch | RaggedKV) -> torch.Tensor:
        hidden = base.embed_tokens(ids)
        return stack(base, hidden, base.rotary_emb(hidden, kv.positions), kv)

    prefill = KVBatch(torch.tensor([0]), torch.arange(5)[None], 5)
    outs = [run(torch.tensor([[5, 9, 33, 100, 7]]), prefill)]
    parts = (KVBatch(torch.tensor([1]), torch.arange(3)[None], 3),
             KVBatch(torch.tensor([0]), torch.tensor([[5]]), 6))
    ragged = RaggedKV(parts, torch.tensor([[0, 1, 2, 5]]))
    outs.append(run(torch.tensor([[4, 8, 15, 16]]), ragged))
    return outs


@pytest.mark.parametrize("family",
                         ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.no_grad()
def test_decoder_stack_equals_hf_layers(tiny_dir: Callable[..., Any], family: str,
                                        dtype: str) -> None:
    llm = LLM(tiny_dir(family), device="cpu", dtype=dtype, experts="torch", progress=False,
              max_seq_len=16)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, 16)
    want = _passes(runner, hf_layers)
    got = _passes(runner, decoder_stack)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype == llm.dtype and a.shape == b.shape, f"pass {n}"
        assert torch.equal(a, b), f"{family} {dtype} pass {n}: |Δ| {(a - b).abs().max():.3g}"
