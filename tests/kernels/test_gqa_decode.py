"""`kernels.gqa_decode` (Triton flash-decoding with the cache write) against a float64 reference:
random shapes (the families' head dims, GQA ratios 1..8), sliding windows, positions 0..C-1,
batch 1..9, more splits than entries; its error never above the torch form's (ops/fused.py
`gqa_decode_attention`, what the CPU runs) by more than its own output rounding; the cache
holds the new entries after it and nothing else changed; bad inputs named. On the GPU when there
is one, else under Triton's interpreter (tests/kernels/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from hetmoe.kernels.gqa_decode import gqa_decode_attention
from hetmoe.ops import fused

HERE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: torch.Tensor,
              slots: torch.Tensor, pos: torch.Tensor, window: int, scale: float
              ) -> torch.Tensor:
    """float64 softmax attention per row and query head -> [B, h, D] float64 (cache before the
    write: entries [lo, pos) of the row's slot, then the own entry)."""
    b, h, d = q.shape
    group = h // k_new.shape[1]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for row in range(b):
        p, slot = int(pos[row]), int(slots[row])
        lo = max(0, p - window + 1) if window else 0
        keys = torch.cat((cache[slot, lo:p, 0], k_new[row, None])).double()  # [L+1, h_kv, D]
        values = torch.cat((cache[slot, lo:p, 1], v_new[row, None])).double()
        for head in range(h):
            kv = head // group
            scores = keys[:, kv] @ q[row, head].double() * scale  # [L+1]
            out[row, head] = torch.softmax(scores, 0) @ values[:, kv]
    return out


def torch_form(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, pos: torch.Tensor, width: int, window: int,
               scale: float) -> torch.Tensor:
    """ops/fused.py's math over the same window (what the kernel replaces)."""
    mask = fused.window_mask(pos, width, window or None)
    out = fused.gqa_decode_attention(q, k_new, v_new, cache[:, :, 0], cache[:, :, 1], slots, mask,
                                     scale)
    return out.view(q.shape)


def make_case(seed: int, b: int, h: int, kv_heads: int, d: int, length: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, ...]:
    """q, k_new, v_new, a cache of b + 2 slots [N, length, 2, h_kv, D], shuffled slots and
    positions in [0, length) that include 0 and length - 1 when b > 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    k_new, v_new = (torch.randn(b, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    cache = (torch.randn(b + 2, length, 2, kv_heads, d, generator=g) * 1.5).to(dtype)
    slots = torch.randperm(b + 2, generator=g)[:b]
    pos = torch.randint(0, length, (b,), generator=g)
    if b > 1:
        pos[0], pos[1] = 0, length - 1
    return q, k_new, v_new, cache, slots, pos


def run(case: tuple[torch.Tensor, ...], num_chunks: int, window: int, scale: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on HERE -> (output, cache after) on the CPU."""
    q, k_new, v_new, cache, slots, pos = (t.to(HERE) for t in case)
    cache = cache.clone()
    lo = fused.window_bounds(pos, window or None)
    out = gqa_decode_attention(q, k_new, v_new, cache, slots, lo, pos, num_chunks, scale)
    return out.cpu(), cache.cpu()


# (batch, query heads, key heads, head dim, cache length, window, dtype): the families' head dims
# (16 baby, 64, 80, 128), GQA ratios 1..8 (3 and 6 pad the group), windows shorter and longer
# than the cache and of 1 (the own entry alone).
CASES = [
    (1, 32, 4, 128, 96, 0, torch.bfloat16),
    (3, 4, 2, 16, 70, 0, torch.float32),
    (9, 6, 2, 64, 130, 0, torch.bfloat16),
    (2, 8, 8, 80, 65, 0, torch.float16),
    (4, 8, 1, 128, 200, 33, torch.bfloat16),
    (5, 12, 2, 64, 129, 1, torch.float32),
    (2, 5, 5, 16, 300, 100, torch.bfloat16),
    (7, 14, 2, 128, 64, 400, torch.float32),
]


@pytest.mark.parametrize(("b", "h", "kv_heads", "d", "length", "window", "dtype"), CASES)
def test_matches_the_float64_reference(b: int, h: int, kv_heads: int, d: int, length: int,
                                       window: int, dtype: torch.dtype) -> None:
    case = make_case(b * 31 + d, b, h, kv_heads, d, length, dtype)
    q, k_new, v_new, cache, slots, pos = case
    scale = 1 / math.sqrt(d)
    want = reference(q, k_new, v_new, cache, slots, pos, window, scale)
    width = int(pos.max()) + 1  # the runner's window covers every row's entries
    num_chunks = max(2, -(-width // 64))
    out, after = run(case, num_chunks, window, scale)
    ours = (out.double() - want).abs().max().item()
    theirs = (torch_form(*case, width, window, scale).double() - want).abs().max().item()
    ulp = torch.finfo(dtype).eps * want.abs().max().item()  # one rounding of the output
    allowed = theirs + ulp
    if HERE == "cuda" and dtype == torch.float32:
        # the GPU sums fp32 dot products in FMA chains in another order than torch's CPU ops and
        # its exp is approximate: an error of the torch form's size, not the same error (a wrong
        # entry or window moves the output by 1e-2 or more)
        allowed = 2 * theirs + 4 * ulp
    assert out.dtype == dtype and out.shape == (b, h, d)
    assert ours <= allowed, f"kernel error {ours:.3g} vs the torch form's {theirs:.3g}"
    written = cache.clone()
    written[slots, pos, 0], written[slots, pos, 1] = k_new, v_new
    assert torch.equal(after, written), "the cache holds the new entries and nothing else changed"


@pytest.mark.parametrize("num_chunks", [2, 3, 9, 40])
def test_splits_give_the_same_output(num_chunks: int) -> None:
    """More splits than entries (empty splits) change only the summation order."""
    case = make_case(5, 3, 8, 2, 64, 150, torch.float32)
    scale = 0.125
    want = reference(*case, 0, scale).float()
    out, _ = run(case, num_chunks, 0, scale)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


def test_every_position_of_a_short_cache() -> None:
    """One row at each position 0..C-1 of a cache of C = 66 (the first entry, chunk edges)."""
    length = 66
    case = list(make_case(9, length, 4, 2, 32, length, torch.float32))
    case[4] = torch.arange(length).roll(3)  # slots: each row its own
    case[5] = torch.arange(length)
    case[3] = torch.randn(length, length, 2, 2, 32, generator=torch.Generator().manual_seed(1))
    want = reference(*case, 0, 0.2).float()
    out, _ = run(tuple(case), 2, 0, 0.2)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


def test_bad_inputs_are_named() -> None:
    q, k_new, v_new, cache, slots, pos = make_case(0, 2, 4, 2, 16, 10, torch.float32)

    def call(**change: torch.Tensor) -> None:
        args = dict(q=q, k_new=k_new, v_new=v_new, kv_cache=cache, slots=slots, lo=pos * 0,
                    pos=pos)
        args.update(change)
        gqa_decode_attention(**args, num_chunks=2, scale=1.0)

    with pytest.raises(ValueError, match=r"q \[B, h, D\] and k_new \[B, h_kv, D\] expected, "
                                         r"got \(2, 64\) and \(2, 2, 16\)"):
        call(q=q.view(2, 64))
    with pytest.raises(ValueError, match=r"k_new / v_new \(2, 3, 16\) / \(2, 2, 16\) do not fit "
                                         r"q \(2, 4, 16\) \(h a multiple of h_kv\)"):
        call(k_new=torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match=r"kv_cache \[N, C, 2, 2, 16\] with unit stride last "
                                         r"expected, got \(4, 10, 2, 16\)"):
        call(kv_cache=cache[:, :, 0])
    with pytest.raises(ValueError, match=r"slots, lo and pos \[2\] expected, got \(2, 1\), "
                                         r"\(2,\) and \(2,\)"):
        call(slots=slots[:, None])
    with pytest.raises(ValueError, match=r"share one dtype, got torch.bfloat16, torch.float32"):
        call(q=q.bfloat16())


def prepared64(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> torch.Tensor:
    """float64 RMSNorm per head then rotate-half rope: x [B, n, D], cos / sin [B, D]."""
    xf = x.double()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    half = x.shape[-1] // 2
    turned = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1)
    return normed * cos.double()[:, None] + turned * sin.double()[:, None]


def prepared_torch(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The fused step's torch ops (ops/fused.py rms_norm, rotate) on x [B, n, D]."""
    normed = fused.rms_norm(x[:, None], weight, eps)  # [B, 1, n, D]
    return fused.rotate(normed.transpose(1, 2), cos[:, None], sin[:, None], "half")[:, :, 0]


@pytest.mark.parametrize(("b", "h", "kv_heads", "d", "dtype"), [
    (1, 32, 4, 128, torch.bfloat16), (3, 4, 2, 16, torch.float32), (2, 6, 2, 64, torch.bfloat16)])
def test_norms_and_rope_in_the_kernel(b: int, h: int, kv_heads: int, d: int,
                                      dtype: torch.dtype) -> None:
    """q and k as projected (views of one fused q/k/v row, as the decode step hands them over),
    normed and rotated in the kernel: against float64 norm, rope and attention, its error at
    most the torch ops' (rms_norm, rotate, then the torch form) plus one output rounding; the
    cache holds the rotated key."""
    g = torch.Generator().manual_seed(d + b)
    length, eps, scale = 100, 1e-6, 1 / math.sqrt(d)
    qkv = (torch.randn(b, (h + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    q, k_new, v_new = (t.view(b, -1, d) for t in qkv.split([h * d, kv_heads * d,
                                                             kv_heads * d], dim=-1))
    q_norm, k_norm = (torch.rand(d, generator=g) + 0.5).to(dtype), torch.rand(d).to(dtype)
    pos = torch.randint(0, length, (b,), generator=g)
    angles = pos[:, None] * 10000.0 ** (-torch.arange(d // 2) / (d // 2))  # [B, D/2]
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    cache = torch.randn(b + 1, length, 2, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(b + 1, generator=g)[:b]
    q64, k64 = (prepared64(x, w, cos, sin, eps) for x, w in ((q, q_norm), (k_new, k_norm)))
    want = reference(q64, k64, v_new, cache, slots, pos, 0, scale)
    q_t, k_t = (prepared_torch(x, w, cos, sin, eps) for x, w in ((q, q_norm), (k_new, k_norm)))
    width = int(pos.max()) + 1
    theirs = torch_form(q_t, k_t, v_new, cache, slots, pos, width, 0, scale)
    after = cache.to(HERE)
    out = gqa_decode_attention(
        q.to(HERE), k_new.to(HERE), v_new.to(HERE), after, slots.to(HERE), (pos * 0).to(HERE),
        pos.to(HERE), max(2, -(-width // 64)), scale, q_norm.to(HERE), k_norm.to(HERE), eps,
        cos.to(HERE), sin.to(HERE)).cpu()
    ours, theirs_err = ((x.double() - want).abs().max().item() for x in (out, theirs))
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    assert ours <= theirs_err + ulp, f"kernel error {ours:.3g} vs the torch ops' {theirs_err:.3g}"
    stored = after.cpu()[slots, pos, 0].double()  # [B, h_kv, D]
    key_err = (stored - k64).abs().max().item()
    torch_key_err = (k_t.double() - k64).abs().max().item()
    assert key_err <= torch_key_err + torch.finfo(dtype).eps * k64.abs().max().item()
    assert torch.equal(after.cpu()[slots, pos, 1], v_new)


def test_bad_prologue_inputs_are_named() -> None:
    q, k_new, v_new, cache, slots, pos = make_case(0, 2, 4, 2, 16, 10, torch.float32)
    base = (q, k_new, v_new, cache, slots, pos * 0, pos, 2, 1.0)
    weight, angle = torch.ones(16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match=r"q_norm / k_norm are given together, got one"):
        gqa_decode_attention(*base, weight, None)
    with pytest.raises(ValueError, match=r"q_norm / k_norm of \[16\] expected, got \[\(16,\), "
                                         r"\(8,\)\]"):
        gqa_decode_attention(*base, weight, torch.ones(8))
    with pytest.raises(ValueError, match=r"cos / sin of \[2, 16\] expected, got \[\(2, 16\), "
                                         r"\(1, 16\)\]"):
        gqa_decode_attention(*base, cos=angle, sin=angle[:1])
    q, k_new, v_new, cache, slots, pos = make_case(0, 2, 4, 2, 15, 10, torch.float32)
    with pytest.raises(ValueError, match=r"rope needs an even head dim, got 15"):
        gqa_decode_attention(q, k_new, v_new, cache, slots, pos * 0, pos, 2, 1.0,
                             cos=torch.zeros(2, 15), sin=torch.zeros(2, 15))
