"""CpuMoE against a float64 oracle on the unquantized weights, for every ISA this machine has."""

from __future__ import annotations

import os

import pytest
import torch
from moe_oracle import available_isas, check_int_isas, make_experts, rel_error

from hetmoe import _cpu_testing
from hetmoe.bench.task_spans import busy_shares, chrome_trace
from hetmoe.experts import CpuMoE

BOUND = {"bf16": 1e-2, "int8": 2e-2, "int4": 0.15}

# (experts, hidden, intermediate, q, k, x dtype, GPU-masked experts): odd expert counts, every q
# and k of the spec, duplicate ids (k > E), -1 ids everywhere.
CASES = [
    (3, 256, 96, 1, 1, torch.float32, ()),
    (5, 192, 64, 2, 2, torch.bfloat16, (1,)),
    (7, 128, 160, 3, 6, torch.float32, (0, 6)),
    (9, 64, 64, 7, 8, torch.bfloat16, ()),
    (5, 160, 96, 64, 6, torch.float32, (2,)),
    (3, 64, 128, 513, 8, torch.float32, ()),
]

# "amx-all" also runs AMX for a single token per expert, so both AMX edge paths are covered.
ISA_VARIANTS = available_isas() + (["amx-all"] if "amx" in available_isas() else [])


def _routing(q: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (q, k), generator=g)
    ids[torch.rand(q, k, generator=g) < 0.2] = -1
    weights = torch.rand(q, k, generator=g)
    return ids, weights


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("weight_format", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", ISA_VARIANTS)
def test_matches_float64_reference(isa: str, weight_format: str, case: int) -> None:
    num_experts, hidden, inter, q, k, dtype, gpu = CASES[case]
    seed = 1000 * case + 10 * ISA_VARIANTS.index(isa) + len(weight_format)
    ref_layer = make_experts(num_experts, hidden, inter, seed)
    moe = CpuMoE(num_experts, hidden, inter, weight_format, isa=isa.removesuffix("-all"),
                 amx_min_tokens=1 if isa == "amx-all" else 32)
    assert moe.isa == isa.removesuffix("-all")
    # Experts on the GPU are never loaded here: routing to them must still work.
    for e in range(num_experts):
        if e not in gpu:
            moe.load_expert(e, ref_layer.gate[e], ref_layer.up[e], ref_layer.down[e])
    mask = None
    if gpu:
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[list(gpu)] = True
        moe.set_gpu_experts(mask)
    # The metric is statistical: small calls are repeated with fresh inputs and the error is
    # taken over all their outputs together (at least 24 tokens).
    outs, refs = [], []
    for rep in range(max(1, 24 // q)):
        g = torch.Generator().manual_seed(seed + 100 * rep)
        x = torch.randn(q, hidden, generator=g).to(dtype)
        ids, weights = _routing(q, k, num_experts, seed + 100 * rep + 1)
        out = torch.full((q, hidden), float("nan"), dtype=dtype)
        assert moe.forward(x, ids, weights, out=out) is out
        assert not out.isnan().any(), "some outputs were never written"
        # Tokens whose every id is skipped must come out exactly zero.
        skipped = ((ids < 0) | (mask[ids.clamp(min=0)] if mask is not None else False)).all(1)
        assert (out[skipped] == 0).all()
        outs.append(out)
        refs.append(ref_layer.reference(x, ids, weights, mask))
    err = rel_error(torch.cat(outs), torch.cat(refs))
    assert err <= BOUND[weight_format], err


@pytest.mark.parametrize("weight_format", ["bf16", "int8", "int4"])
def test_realistic_shape(weight_format: str) -> None:
    """Qwen3-30B-A3B's expert shape (H=2048, I=768), top-4 of 5 experts, at the best ISA."""
    layer = make_experts(5, 2048, 768, seed=7)
    moe = CpuMoE(5, 2048, 768, weight_format)
    moe.load(layer.gate, layer.up, layer.down)
    x = torch.randn(24, 2048, generator=torch.Generator().manual_seed(8))
    ids, weights = _routing(24, 4, 5, seed=9)
    err = rel_error(moe.forward(x, ids, weights), layer.reference(x, ids, weights))
    assert err <= BOUND[weight_format], err


@pytest.mark.parametrize(("weight_format", "group_size", "bound"),
                         [("int8", 128, 2e-2), ("int4", 256, 0.2)])
def test_large_groups(weight_format: str, group_size: int, bound: float) -> None:
    """Groups spanning several 64-wide blocks: every ISA (AMX for every call too) computes the
    scalar result (int4 on AMX: check_int_isas); the error grows with the group (int4 meets 0.15
    only up to 64)."""
    layer = make_experts(3, 256, 256, seed=41)
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(42))
    ids, weights = _routing(48, 2, 3, seed=43)
    outs = {}
    for isa in available_isas():
        moe = CpuMoE(3, 256, 256, weight_format, group_size=group_size, isa=isa,
                     amx_min_tokens=1)
        moe.load(layer.gate, layer.up, layer.down)
        outs[isa] = moe.forward(x, ids, weights)
    check_int_isas(weight_format, outs, layer.reference(x, ids, weights), bound)


@pytest.mark.parametrize(("weight_format", "group_size", "bound"),
                         [("int8", 128, 2e-2), ("int8", 256, 2e-2), ("int4", 128, 0.2)])
def test_decode_splits_large_groups(weight_format: str, group_size: int, bound: float) -> None:
    """Decode (q <= 4) computes a group wider than 64 hidden columns in parts on several tasks:
    each token comes out exactly as in a larger (undivided) call, on every ISA (AMX for every
    call too), and every ISA gives the scalar result (int4 on AMX tiles: check_int_isas)."""
    layer = make_experts(3, 256, 256, seed=51)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(52))
    ids, weights = _routing(4, 3, 3, seed=53)
    by_isa = {}
    for isa in ISA_VARIANTS:
        moe = CpuMoE(3, 256, 256, weight_format, group_size=group_size,
                     isa=isa.removesuffix("-all"), amx_min_tokens=1 if isa == "amx-all" else 32)
        moe.load(layer.gate, layer.up, layer.down)
        undivided = moe.forward(x.repeat(2, 1), ids.repeat(2, 1), weights.repeat(2, 1))
        for width in (32, 64, 128):  # parts of 32 or 64 columns, or whole groups of 128
            _cpu_testing.set_decode_cols(moe._layer, width)
            decode = torch.cat([moe.forward(x[t:t + 1], ids[t:t + 1], weights[t:t + 1])
                                for t in range(4)])
            assert torch.equal(moe.forward(x, ids, weights), decode)  # q=4, also split
            assert torch.equal(undivided[:4], decode), (isa, width)
        with pytest.raises(ValueError, match=r"decode_cols must be 32, 64 or 128, got 48"):
            _cpu_testing.set_decode_cols(moe._layer, 48)
        # "amx" decodes on the AVX-512 kernels (below amx_min_tokens), "amx-all" on tiles
        by_isa[{"amx": "amx (AVX-512 kernels)", "amx-all": "amx"}.get(isa, isa)] = decode
    check_int_isas(weight_format, by_isa, layer.reference(x, ids, weights), bound)


def test_profile_and_read_bandwidth() -> None:
    """The benchmark's probes: per-phase times of a profiled call, and the pool read rate."""
    from hetmoe import _cpu

    layer = make_experts(3, 64, 64, seed=51)
    moe = CpuMoE(3, 64, 64, "bf16")
    moe.load(layer.gate, layer.up, layer.down)
    _cpu_testing.set_profile(moe._layer, True)
    moe.forward(torch.randn(5, 64), torch.randint(0, 3, (5, 2)), torch.rand(5, 2))
    phases = _cpu_testing.phase_us(moe._layer)
    assert len(phases) == 5 and all(p >= 0 for p in phases) and phases[2] > 0
    assert _cpu.read_bandwidth(16 << 20, 2) > 1e8  # bytes/s: any machine reads > 0.1 GB/s


def test_timeline_orders_each_profiled_call() -> None:
    """take_timeline: one row per profiled call (decode: gate/up, down, combine; prefill: every
    phase), times in order start <= built <= each phase's first start <= its last end <= done,
    and taking clears it."""
    layer = make_experts(3, 64, 64, seed=52)
    moe = CpuMoE(3, 64, 64, "bf16")
    moe.load(layer.gate, layer.up, layer.down)
    moe.forward(torch.randn(1, 64), torch.tensor([[0, 2]]), torch.rand(1, 2))  # not profiled
    _cpu_testing.set_profile(moe._layer, True)
    for q in (1, 100):  # 100 tokens x 2 slots on 3 experts: >= 32 rows each, all 5 phases
        moe.forward(torch.randn(q, 64), torch.randint(0, 3, (q, 2)), torch.rand(q, 2))
    rows = _cpu_testing.take_timeline(moe._layer)
    assert len(rows) == 2 and all(len(r) == 3 + 2 * 5 + 3 for r in rows)
    assert all(r[-3:] == [0, 0, 0] for r in rows)  # picked, made, claimed: flagged jobs only
    for row, ran in zip(rows, ([2, 3, 4], [0, 1, 2, 3, 4]), strict=True):
        start, built, done = row[:3]
        spans = [(row[3 + 2 * i], row[4 + 2 * i]) for i in range(5)]
        assert [i for i, (first, _) in enumerate(spans) if first] == ran
        assert start <= built <= min(spans[i][0] for i in ran)
        assert all(first <= last <= done for first, last in (spans[i] for i in ran))
    assert _cpu_testing.take_timeline(moe._layer) == []


def test_task_spans_cover_every_task_of_the_profiled_call() -> None:
    """task_spans: none unless asked for; with spans, the tasks of the latest profiled call span
    exactly each phase's first start and last end (take_timeline), on the pool's workers; the
    busy shares the benchmark derives from them lie in (0, 1]."""

    layer = make_experts(3, 64, 64, seed=53)
    moe = CpuMoE(3, 64, 64, "int8", threads=2)
    moe.load(layer.gate, layer.up, layer.down)
    _cpu_testing.set_profile(moe._layer, True)  # phase times only: no spans kept
    moe.forward(torch.randn(100, 64), torch.randint(0, 3, (100, 2)), torch.rand(100, 2))
    assert _cpu_testing.task_spans(moe._layer) == []
    _cpu_testing.take_timeline(moe._layer)
    _cpu_testing.set_profile(moe._layer, True, spans=True)
    moe.forward(torch.randn(100, 64), torch.randint(0, 3, (100, 2)), torch.rand(100, 2))
    spans = _cpu_testing.task_spans(moe._layer)
    row = _cpu_testing.take_timeline(moe._layer)[-1]
    assert {s[0] for s in spans} == {0, 1, 2, 3, 4}  # every prefill phase ran
    for slot in range(5):
        mine = [s for s in spans if s[0] == slot]
        first, last = row[3 + 2 * slot], row[4 + 2 * slot]
        assert min(s[3] for s in mine) == first and max(s[4] for s in mine) == last
        assert all(s[3] <= s[4] for s in mine)
    assert {(s[1], s[2]) for s in spans} <= {(0, 0), (0, 1)}  # group 0's two workers
    shares = busy_shares([list(s) for s in spans])
    assert all(0 < v <= 1 for v in shares)
    events = chrome_trace([list(s) for s in spans])["traceEvents"]
    assert len(events) == len(spans) and min(e["ts"] for e in events) == 0
    _cpu_testing.set_profile(moe._layer, False)
    moe.forward(torch.randn(2, 64), torch.randint(0, 3, (2, 2)), torch.rand(2, 2))
    # an unprofiled call keeps the last profiled one
    assert _cpu_testing.task_spans(moe._layer) == spans


def test_isas_agree_closely() -> None:
    """Every ISA computes the same packed function: int8 results agree far below the bound."""
    layer = make_experts(5, 128, 96, seed=3)
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(4))
    ids, weights = _routing(37, 4, 5, seed=5)
    outs = []
    for isa in available_isas():
        moe = CpuMoE(5, 128, 96, "int8", isa=isa, amx_min_tokens=1)
        moe.load(layer.gate, layer.up, layer.down)
        outs.append(moe.forward(x, ids, weights))
    for out in outs[1:]:
        assert rel_error(out, outs[0].double()) < 1e-5


def test_fp16_and_fp8_sources() -> None:
    """fp16 weights and FP8 e4m3 weights with 128x128 block scales load like their float value."""
    layer = make_experts(3, 256, 128, seed=11)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(12))
    ids, weights = _routing(5, 2, 3, seed=13)
    half = CpuMoE(3, 256, 128, "bf16")
    half.load(layer.gate.half(), layer.up.half(), layer.down.half())
    assert rel_error(half.forward(x, ids, weights), layer.reference(x, ids, weights)) < 1e-2

    def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = w.unflatten(1, (-1, 128)).unflatten(3, (-1, 128))  # [E, r, 128, c, 128]
        scale = blocks.abs().amax((2, 4)) / 448.0  # [E, r, c]
        full = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
        return (w / full).to(torch.float8_e4m3fn), scale

    (g8, gs), (u8, us), (d8, ds) = fp8(layer.gate), fp8(layer.up), fp8(layer.down)
    moe = CpuMoE(3, 256, 128, "bf16")
    moe.load(g8, u8, d8, gs, us, ds)
    # e4m3 keeps 3 mantissa bits: the oracle here is the dequantized FP8 weights.
    deq = [t.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
           for t, s in ((g8, gs), (u8, us), (d8, ds))]
    oracle = type(layer)(*deq)
    assert rel_error(moe.forward(x, ids, weights), oracle.reference(x, ids, weights)) < 1e-2


@pytest.mark.parametrize("weight_format", ["bf16", "int8", "int4"])
def test_one_mapping_per_layer(weight_format: str) -> None:
    """A layer's experts share one memory mapping per NUMA group, scales included: a model of
    tens of thousands of matrices stays far under the kernel's vm.max_map_count (65530), and the
    weights lie in one huge-page-aligned run instead of a 4 KiB-paged head and tail per matrix."""
    e, h, i = 24, 1024, 1024
    layer = make_experts(e, h, i, seed=7)

    def mappings() -> int:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)

    CpuMoE(e, h, i, weight_format, threads=2)  # the pool of 2 threads built before counting
    before = mappings()
    moe = CpuMoE(e, h, i, weight_format, threads=2)  # the mapping is made here, touched by load
    moe.load(layer.gate, layer.up, layer.down)
    assert mappings() - before <= 2  # one group here (the mapping may split where it is touched)


@pytest.mark.parametrize("weight_format", ["bf16", "int8"])
def test_decode_is_the_same_on_every_worker_count(weight_format: str) -> None:
    """Decode runs gate/up and down as one phase, each down task waiting for its expert's gate/up
    tasks: on every allowed core (workers and this thread share them, so workers are preempted
    mid-task), every call gives the floats of a one-worker pool."""
    e, h, i = 6, 256, 320
    layer = make_experts(e, h, i, seed=61)
    cores = len(os.sched_getaffinity(0))
    one, many = CpuMoE(e, h, i, weight_format, threads=1), CpuMoE(e, h, i, weight_format,
                                                                   threads=cores)
    for moe in (one, many):
        moe.load(layer.gate, layer.up, layer.down)
    generator = torch.Generator().manual_seed(62)
    for call in range(60):
        q = 1 + call % 3
        x = torch.randn(q, h, generator=generator)
        ids, weights = _routing(q, 4, e, seed=100 + call)
        assert torch.equal(many.forward(x, ids, weights), one.forward(x, ids, weights)), call
