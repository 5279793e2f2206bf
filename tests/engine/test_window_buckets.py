"""Decode attention over window buckets (ops/kv_batch.py `window_bucket`) equals the whole window.

Baby models with max_seq_len 40 (not a power of two) and buckets of 8, 16, 32 and 40: two
sequences of different lengths decode together from 6 to 39 cached entries, so every bucket
boundary is crossed; the same steps with one bucket of 40 (the whole window) are the reference.
The fused path's window chunks are 4 entries here (2, 4, 8 and 10 chunks), not 64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from decode_rows import greedy_rows
from decode_steps import SAME_BACKEND_ATOL

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops import fused
from hetmoe.ops.kv_batch import window_bucket

MAX_SEQ_LEN = 40
SMALLEST = 8
PROMPTS = [[5, 9, 33, 100, 7], [11, 12, 13]]
STEPS = MAX_SEQ_LEN - len(PROMPTS[0]) - 1  # the longest row ends at 39 cached entries
WANT_WINDOWS = {8: 3, 16: 8, 32: 16, 40: 7}
"""Steps per bucket: the longest row holds 6..39 entries after a step."""


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window chunks of 4 entries, so the baby windows span several chunks."""
    monkeypatch.setattr(fused, "WINDOW_CHUNK", 4)


@pytest.fixture(scope="module")
def short_engine(tiny_dir: Callable[..., Any]) -> Callable[..., LLM]:
    """`short_engine(family, **config)`: a cached fp32 CPU `LLM` with max_seq_len 40."""
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], LLM] = {}

    def get(family: str, **config: Any) -> LLM:
        key = (family, tuple(sorted(config.items())))
        if key not in built:
            built[key] = LLM(tiny_dir(family, **config), device="cpu", dtype="float32",
                             experts="cpu", progress=False, max_seq_len=MAX_SEQ_LEN)
        return built[key]

    return get


def decode_batch(llm: LLM, fused: bool, smallest: int
                 ) -> tuple[list[list[int]], list[torch.Tensor], dict[int, int], bool]:
    """Both prompts prefilled into their own slots, then STEPS greedy steps of the pair;
    (tokens per row, [2, V] logits per step, steps per window bucket, fused path used)."""
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 2, MAX_SEQ_LEN,
                         EngineConfig(fused_decode=fused, smallest_window=smallest))
    try:
        tokens, logits = greedy_rows(runner, PROMPTS, STEPS)
        assert max(runner.lengths) == MAX_SEQ_LEN - 1
    finally:
        runner.overlap.detach()
    return tokens, logits, dict(runner.windows), runner.fused is not None


def test_window_bucket_widths() -> None:
    assert [window_bucket(n, 8, 40) for n in (1, 8, 9, 16, 17, 32, 33, 40)] == [
        8, 8, 16, 16, 32, 32, 40, 40]
    assert window_bucket(300, 256, 4096) == 512
    assert window_bucket(4096, 256, 4096) == 4096
    assert window_bucket(3000, 256, 4392) == 4096
    assert window_bucket(4097, 256, 4392) == 4392
    assert window_bucket(5, 256, 100) == 100  # a window shorter than the smallest bucket
    with pytest.raises(ValueError, match=r"length 41 is outside 1\.\.40 \(the cache length\)"):
        window_bucket(41, 8, 40)
    with pytest.raises(ValueError, match=r"length 0 is outside"):
        window_bucket(0, 8, 40)


def test_smallest_window_is_checked() -> None:
    with pytest.raises(ValueError, match=r"smallest_window must be an integer >= 2, got 1"):
        EngineConfig(smallest_window=1)


@pytest.mark.parametrize(("family", "config", "fused"), [
    ("qwen3_moe", {}, True),  # GQA with q/k norms
    ("deepseek_v2", {}, True),  # MLA
    ("mixtral", {"sliding_window": 6}, True),  # a sliding window narrower than the buckets
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
     True),  # sliding and full layers in one model: two masks per step
    ("qwen3_moe", {}, False),  # the HF layers (module path)
    ("deepseek_v2", {}, False),
])
def test_buckets_equal_the_whole_window(
    short_engine: Callable[..., LLM], small_chunks: None, family: str, config: dict[str, Any],
    fused: bool,
) -> None:
    llm = short_engine(family, **config)
    want_tokens, want, whole, _ = decode_batch(llm, fused, smallest=MAX_SEQ_LEN)
    tokens, logits, windows, used = decode_batch(llm, fused, smallest=SMALLEST)
    assert used == fused, f"{family}: fused path used {used}, wanted {fused}"
    assert whole == {MAX_SEQ_LEN: STEPS}
    assert windows == WANT_WINDOWS
    assert tokens == want_tokens
    for step, (ours, ref) in enumerate(zip(logits, want, strict=True)):
        delta = (ours - ref).abs().max().item()
        # A wider window only adds exact zeros, in another summation order.
        assert delta <= SAME_BACKEND_ATOL, f"{family} step {step}: max |Δlogits| {delta:.3g}"


@pytest.mark.parametrize(("chunk", "width", "window"), [
    (4, 16, None), (4, 40, None), (64, 40, None), (8, 40, 6), (3, 40, 5)])
def test_chunked_attention_equals_one_softmax(
    monkeypatch: pytest.MonkeyPatch, chunk: int, width: int, window: int | None
) -> None:
    """GQA and MLA decode attention over window chunks (the last ones padded, reads past the
    cache clamped) against one softmax over exactly the visible entries, rows at their own
    positions (one row at the last position of the cache)."""
    monkeypatch.setattr(fused, "WINDOW_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    slots, pos = torch.tensor([2, 0, 1]), torch.tensor([3, 11, 39])
    pos = pos.clamp(max=width - 1)
    mask = fused.window_mask(pos, width, window)
    assert mask.shape == (3, max(2, -(-width // chunk)), chunk)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    def visible(row: int) -> torch.Tensor:
        keys = torch.arange(int(pos[row]))
        return keys[pos[row] - keys < window] if window is not None else keys

    q, k_new, v_new, kv = rand(3, 4, 8), rand(3, 2, 8), rand(3, 2, 8), rand(3, 40, 2, 2, 8)
    out = fused.gqa_decode_attention(q, k_new, v_new, kv[:, :, 0], kv[:, :, 1], slots, mask,
                                     0.3)  # [B, h*D]
    for row in range(3):
        keys = torch.cat((kv[slots[row], visible(row), 0], k_new[row, None]))  # [n+1, h_kv, D]
        values = torch.cat((kv[slots[row], visible(row), 1], v_new[row, None]))
        qg = q[row].view(2, 2, 8)  # [h_kv, g, D]
        probs = (torch.einsum("kgd,nkd->kgn", qg, keys) * 0.3).softmax(-1)
        want = torch.einsum("kgn,nkd->kgd", probs, values).reshape(-1)
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-6)

    q_lat, q_rot, lat_new, rot_new = rand(3, 4, 16), rand(3, 4, 4), rand(3, 16), rand(3, 4)
    latent, rope = rand(3, 40, 16), rand(3, 40, 4)
    out = fused.mla_decode_attention(q_lat, q_rot, lat_new, rot_new, latent, rope, slots, mask,
                                     0.3)  # [B, h, r]
    for row in range(3):
        lat = torch.cat((latent[slots[row], visible(row)], lat_new[row, None]))  # [n+1, r]
        rot = torch.cat((rope[slots[row], visible(row)], rot_new[row, None]))
        probs = ((q_lat[row] @ lat.T + q_rot[row] @ rot.T) * 0.3).softmax(-1)  # [h, n+1]
        torch.testing.assert_close(out[row], probs @ lat, rtol=1e-5, atol=1e-6)
