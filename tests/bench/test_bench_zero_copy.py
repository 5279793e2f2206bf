"""benchmarks/kernels/bench_zero_copy.py: the byte-sum read kernel (under Triton's interpreter on
CPU tensors here; on the GPU over pinned host memory with -m device), its arguments, the CPU
decode window's rate, the pair-kernel part with a stand-in timer, and the tables."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_script import load_script

from hetmoe.experts.packed_layout import host_tensor

SCRIPT = load_script("kernels/bench_zero_copy.py")

HOPPER = f"""
import re, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench_script import load_script
from hopper_compile import compile_for_hopper

script = load_script("kernels/bench_zero_copy.py")
types = {{"src": "*u8", "out": "*i64", "n": "i64", "iters": "i32"}}
ptx = compile_for_hopper(script.sum_bytes_kernel, types, aligned=True, options={{"num_warps": 4}},
                         BLOCK=4096, UNROLL=4).asm["ptx"]
# 4096 bytes over 128 threads: 2 loads of 16 bytes a thread a step, 4 steps in flight
loads = re.findall(r"ld\\.global\\S*", ptx)
assert loads == ["ld.global.v4.b32"] * 8, loads
print("compiled")
"""


@pytest.mark.parametrize(("n", "shape", "programs"), [
    (100_003, "1,1,512,1", 3),    # a tail no chunk fills, masked
    (40_960, "1,2,1024,4", 2),    # whole chunks
    (5_000, "1,4,2048,2", 7),     # programs with nothing to read store 0
])
def test_sum_bytes_equals_torch(n: int, shape: str, programs: int) -> None:
    src = torch.randint(0, 256, (n,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(n))
    sums = SCRIPT.sum_bytes(src, SCRIPT.parse_shape(shape), programs)
    assert sums.shape == (programs,) and sums.dtype == torch.int64
    assert int(sums.sum()) == int(src.sum(dtype=torch.int64))
    if n == 5_000:  # chunk 4096: program 0 reads 4096 bytes, program 1 the other 904
        assert int(sums[0]) == int(src[:4096].sum(dtype=torch.int64))
        assert sums[2:].tolist() == [0] * 5


def test_sum_bytes_refuses_what_it_cannot_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = SCRIPT.parse_shape("1,1,512,1")
    with pytest.raises(ValueError, match=r"src must be a contiguous 1-D uint8 tensor, got "
                                         r"torch.int8 \[4\]"):
        SCRIPT.sum_bytes(torch.zeros(4, dtype=torch.int8), shape, 1)
    monkeypatch.setattr(SCRIPT, "LANE_LIMIT", 2)
    with pytest.raises(ValueError, match="2048 bytes over 1 programs of block 512 overflow a "
                                         "lane's int32 sum; use more programs"):
        SCRIPT.sum_bytes(torch.zeros(2048, dtype=torch.uint8), shape, 1)


def test_shapes_parse_and_bad_ones_are_named() -> None:
    assert SCRIPT.parse_shape("4,8,8192,2") == SCRIPT.ReadShape(4, 8, 8192, 2)
    assert [SCRIPT.parse_shape(s) for s in SCRIPT.SHAPES]  # the defaults are valid
    for text, message in [("4,4,4096", "four positive integers per_sm,warps,block,unroll"),
                          ("4,4,4096,0", "four positive integers"),
                          ("4,3,4096,1", "warps must be 1, 2, 4, 8 or 16, got 3"),
                          ("4,4,3000,1", "block must be a power of two of at least 16 bytes a "
                                         "thread .2048 at 4 warps., got 3000"),
                          ("4,4,1024,1", "got 1024")]:
        with pytest.raises(ValueError, match=message):
            SCRIPT.parse_shape(text)


@pytest.mark.parametrize(("argv", "message"), [
    (["--shapes", "4,3,4096,1"], "warps must be 1, 2, 4, 8 or 16, got 3"),
    (["--shape", "nope"], "nope"),
    (["--gib", "0"], "--gib must be between 1/64 and 16, got 0.0"),
    (["--cpu-layers", "0"], "--cpu-layers must be at least 1, got 0"),
    (["--calls", "0"], "--calls must be at least 1, got 0"),
    (["--seconds", "-1"], "--seconds must be positive, got -1.0"),
    (["--tokens", "1,x"], "--tokens takes positive integers, comma-separated, got '1,x'"),
    ([], "needs a CUDA GPU .the GPU's reads of host memory are what it measures.; torch sees "
         "none"),
])
def test_bad_arguments_are_named_before_any_gpu_work(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        SCRIPT.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_cpu_rate_counts_the_calls_inside_the_window() -> None:
    layer = SCRIPT.int8_layers(1, 4, 128, 64)[0]
    cpu = SCRIPT.CpuDecode([layer], 2)
    cpu.calls = [(0.0, 1.0, 100), (1.0, 1.5, 300), (1.5, 3.0, 900)]
    assert cpu.rate(0.5, 3.0) == pytest.approx(1200 / 2.0)  # the first call started before
    assert cpu.rate(0.0, math_inf()) == pytest.approx(1300 / 3.0)
    with pytest.raises(RuntimeError, match="no call ran wholly within the 0.200 s window"):
        cpu.rate(1.1, 1.3)


def math_inf() -> float:
    return float("inf")


def test_cpu_decode_calls_the_layers_in_turn_with_k_experts() -> None:
    layers = SCRIPT.int8_layers(2, 4, 128, 64)
    assert layers[0].packed_groups()[0].address != layers[1].packed_groups()[0].address
    a, b = (host_tensor(m.packed_groups()[0]) for m in layers)
    assert torch.equal(a, b)  # the same experts, each layer in its own memory
    with SCRIPT.CpuDecode(layers, 2) as cpu:
        while len(cpu.calls) < 4:
            pass
    per_call = 2 * layers[0].packed_groups()[0].expert_bytes
    assert all(n == per_call and end >= start for start, end, n in cpu.calls)


def test_pair_rows_time_each_source_and_name_a_refused_one() -> None:
    layer = SCRIPT.int8_layers(1, 4, 128, 64)[0]
    raw = host_tensor(layer.packed_groups()[0])
    timed: list[int] = []

    def timer(fn: Any, repeats: int) -> float:
        fn()
        timed.append(repeats)
        return 6.0  # ms a graph of 3 calls

    def refused() -> torch.Tensor:
        raise RuntimeError("cudaHostRegister failed")

    sources = {"device": lambda: raw, "copy": raw.clone, "registered": refused}
    rows = SCRIPT.pair_rows(layer, sources, [1], 2, 3, 5, timer)
    expert = layer.packed_groups()[0].expert_bytes
    assert timed == [5, 5]
    assert [r["source"] for r in rows] == ["device", "copy", "registered"]
    assert rows[0]["ms"] == rows[1]["ms"] == 2.0
    assert rows[0]["gb_s"] == round(2 * expert / 2.0 / 1e6, 2)  # 2 distinct experts a call
    assert rows[2] == {"source": "registered", "tokens": 1, "error": "cudaHostRegister failed"}


def test_pair_rows_refuse_sources_that_disagree() -> None:
    layer = SCRIPT.int8_layers(1, 4, 128, 64)[0]
    raw = host_tensor(layer.packed_groups()[0])
    other = raw.clone()
    other[: other.numel() // 2] = 1

    def timer(fn: Any, repeats: int) -> float:
        fn()
        return 1.0

    with pytest.raises(AssertionError, match="pairs from other T=2: outputs differ from "
                                             "device's by"):
        SCRIPT.pair_rows(layer, {"device": lambda: raw, "other": lambda: other}, [2], 2, 2, 1,
                         timer)


def test_tables_from_fake_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    report = {
        "read": [{"source": "device", "shape": [4, 4, 4096, 4], "gb_s": 2900.5},
                 {"source": "pinned_direct", "shape": [4, 4, 4096, 4],
                  "error": "Pointer argument cannot be accessed from Triton (cpu tensor?)"},
                 {"source": "copy_h2d", "shape": None, "gb_s": 54.1}],
        "overlap": {"copy_h2d": {"gpu_alone_gb_s": 54.0, "gpu_with_cpu_gb_s": 40.0,
                                 "cpu_alone_gb_s": 80.0, "cpu_with_gpu_gb_s": 70.0,
                                 "sum_together_gb_s": 110.0, "gain_over_cpu": 1.375}},
        "pairs": [{"source": "device", "tokens": 1, "ms": 0.02, "gb_s": 2000.0},
                  {"source": "host_registered", "tokens": 1, "error": "refused"}],
    }
    SCRIPT.print_tables(report)
    out = capsys.readouterr().out.splitlines()
    assert "| device | (4, 4, 4096, 4) | 2900.5 |" in out
    assert ("| pinned_direct | (4, 4, 4096, 4) | Pointer argument cannot be accessed from "
            "Triton (cpu tensor?) |") in out
    assert "| copy_h2d | - | 54.1 |" in out
    assert "| copy_h2d | 54.0 | 40.0 | 80.0 | 70.0 | 110.0 | 1.38x |" in out
    assert "| device | 1 | 0.02 | 2000.0 |" in out
    assert "| host_registered | 1 | refused | - |" in out


def test_tables_leave_out_parts_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    SCRIPT.print_tables({"read": []})
    out = capsys.readouterr().out
    assert "GPU reader" not in out and "pairs:" not in out


def test_the_read_kernel_compiles_to_16_byte_loads_for_hopper() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
    try:
        from hopper_compile import assert_compiles_for_hopper
    finally:
        sys.path.pop(0)
    assert_compiles_for_hopper(HOPPER)


@pytest.mark.device
def test_triton_reads_pinned_host_memory_in_place() -> None:
    """Triton's launcher takes a pinned CPU tensor's pointer (cuPointerGetAttribute maps it),
    and the gpu_view of it, and both sums equal torch's."""
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).pin_memory()
    shape = SCRIPT.parse_shape("2,4,4096,2")
    want = int(src.sum(dtype=torch.int64))
    for view in (src, SCRIPT.uint8_view(src)):
        out = torch.empty(8, dtype=torch.int64, device="cuda")
        assert int(SCRIPT.sum_bytes(view, shape, 8, out).sum()) == want
