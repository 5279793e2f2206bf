"""ops/fused.py: the decode-step functions against the module path's math, on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from hetmoe.ops import fused
from hetmoe.ops.attention import attend
from hetmoe.ops.kv_batch import KVBatch
from hetmoe.ops.rope import apply_rope


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm forward, written out (Qwen3MoeRMSNorm and its copies)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6))


def test_pack_round_trips_ids_weights_and_x_bit_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, -1, 0], [127, 3, -1], [-1, -1, 2]])
    weights = torch.rand(3, 3, generator=g)
    stage = fused.pack_moe_inputs(x, ids, weights)
    assert stage.dtype == torch.int32 and stage.numel() == fused.staged_words(3, 8, 3) == 51
    got_x, got_ids, got_w = fused.unpack_moe_inputs(stage, 3, 8, 3)
    assert torch.equal(got_x, x.float()) and torch.equal(got_ids, ids)
    assert torch.equal(got_w, weights)
    assert got_ids.dtype == torch.int64 and got_ids.is_contiguous() and got_x.is_contiguous()


def _cache_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The module path: write the new entries, then attend with the causal mask."""
    cache = cache.clone()
    kv = KVBatch(slots, pos[:, None], cache.shape[1])
    keys = kv.write(cache[:, :, 0], k_new[:, None]).transpose(1, 2)  # [B, h_kv, L, D]
    values = kv.write(cache[:, :, 1], v_new[:, None]).transpose(1, 2)
    out = attend(q[:, :, None], keys, values, scale, kv.mask())  # [B, 1, h, D]
    return out.reshape(q.shape[0], -1)


def test_gqa_decode_attention_matches_write_then_attend() -> None:
    g = torch.Generator().manual_seed(2)
    b, h, h_kv, d, n, length = 2, 8, 2, 16, 3, 12
    cache = torch.randn(n, length, 2, h_kv, d, generator=g)
    q = torch.randn(b, h, d, generator=g)
    k_new, v_new = torch.randn(2, b, h_kv, d, generator=g)
    slots, pos = torch.tensor([2, 0]), torch.tensor([5, 9])
    mask = fused.window_mask(pos, length, None)  # [B, n, c]
    got = fused.gqa_decode_attention(q, k_new, v_new, cache[:, :, 0], cache[:, :, 1], slots,
                                     mask, 0.25)
    want = _cache_reference(q, k_new, v_new, cache, slots, pos, 0.25)
    assert got.shape == (b, h * d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mla_decode_attention_matches_attention_over_the_written_cache() -> None:
    g = torch.Generator().manual_seed(3)
    b, h, r, d, length = 2, 4, 16, 8, 10
    latent_cache = torch.randn(2, length, r, generator=g)
    rope_cache = torch.randn(2, length, d, generator=g)
    q_latent, q_rot = torch.randn(b, h, r, generator=g), torch.randn(b, h, d, generator=g)
    latent_new, k_rot_new = torch.randn(b, r, generator=g), torch.randn(b, d, generator=g)
    slots, pos = torch.tensor([1, 0]), torch.tensor([4, 7])
    mask = fused.window_mask(pos, length, None)
    got = fused.mla_decode_attention(q_latent, q_rot, latent_new, k_rot_new, latent_cache,
                                     rope_cache, slots, mask, 0.3)
    latent_cache[slots, pos], rope_cache[slots, pos] = latent_new, k_rot_new
    keys = torch.cat((latent_cache, rope_cache), dim=-1)[slots]  # [B, L, r+d]
    scores = torch.einsum("bhc,blc->bhl", torch.cat((q_latent, q_rot), -1), keys) * 0.3
    allowed = torch.arange(length)[None] <= pos[:, None]
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    want = torch.einsum("bhl,blr->bhr", probs, latent_cache[slots])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_pairs_is_the_complex_rotation() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 1, 8, generator=g)
    angles = torch.randn(2, 1, 4, generator=g)
    freqs = torch.polar(torch.ones_like(angles), angles)  # DeepSeek-V2's freqs_cis [B, S, D/2]
    want = apply_rope(x, freqs)
    torch.testing.assert_close(fused.rotate(x, freqs.real, freqs.imag, "pairs"), want)


def test_swiglu_is_the_gated_mlp() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, generator=g)
    gate, up, down = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), \
        torch.randn(8, 6, generator=g)
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(fused.swiglu(x, gate, up, down), want)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_equals_the_router(family: str, dtype: torch.dtype) -> None:
    from hetmoe.ops.router import RouterConfig, route
    from hetmoe.presets.tiny import tiny_config

    config = RouterConfig.from_hf(tiny_config(family))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g).to(dtype)
    weight = torch.randn(config.num_experts, 64, generator=g).to(dtype)
    bias = torch.rand(config.num_experts, generator=g) if config.has_bias else None
    want_ids, want = route(x, weight, bias, config)
    ids, weights = route(x, weight, bias, config, fused=True)
    assert torch.equal(ids, want_ids)  # random scores: no ties
    torch.testing.assert_close(weights, want, atol=1e-6, rtol=1e-5)


def test_top_k_ids_is_topk_best_first() -> None:
    from hetmoe.ops.router import top_k_ids

    scores = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    assert torch.equal(top_k_ids(scores, 5), torch.topk(scores, 5).indices)


@pytest.mark.parametrize("window", [None, 1, 5, 70])
def test_window_bounds_are_the_masks_first_entries(window: int | None) -> None:
    """The kernels' lo: each row's attended entries are exactly [lo, pos) of `window_mask`."""
    pos = torch.tensor([0, 1, 4, 5, 63, 64, 100])
    mask = fused.window_mask(pos, 101, window).flatten(1)  # [B, n c]
    lo = fused.window_bounds(pos, window)
    for row in range(len(pos)):
        keys = mask[row].nonzero().flatten().tolist()
        assert keys == list(range(int(lo[row]), int(pos[row]))), f"row {row}"


def test_residual_rounds_each_term_to_h_then_sums_in_order() -> None:
    h = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    routed = torch.tensor([1 / 3, 2**-9], dtype=torch.float32)  # fp32, as the fused step's
    shared = torch.tensor([0.25, 2**-9], dtype=torch.bfloat16)
    terms = routed.to(torch.bfloat16) + shared
    assert torch.equal(fused.sum_terms([routed, shared], torch.bfloat16), terms)
    got = fused.residual(h, (routed, shared))
    assert got.dtype == torch.bfloat16 and torch.equal(got, h + terms)
    assert fused.residual(h, ()) is h


def test_absorbed_weights_are_views_of_kv_b_per_head() -> None:
    heads, nope, v, rank = 3, 4, 5, 6
    kv_b = torch.randn(heads * (nope + v), rank, generator=torch.Generator().manual_seed(8))
    w_k, w_v = fused.absorbed_weights(kv_b, heads, nope, v)
    assert w_k.shape == (heads, nope, rank) and w_v.shape == (heads, v, rank)
    assert w_k.data_ptr() == kv_b.data_ptr()  # views: no copy of the weight
    for head in range(heads):
        rows = kv_b[head * (nope + v):(head + 1) * (nope + v)]
        assert torch.equal(w_k[head], rows[:nope]) and torch.equal(w_v[head], rows[nope:])
