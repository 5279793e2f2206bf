"""benchmarks/kernels/bench_pair_cold.py: the pair kernels timed hot (the pair sweep's one
layer) and cold (each call on its own copy, x fp32, as the decode step calls them); the timed
calls run under Triton's interpreter here, with a stand-in timer that calls them once."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from bench_script import load_script

from hetmoe.experts.packed_layout import host_tensor
from hetmoe.kernels.pair_config import ONE_TOKEN_PAIR_CONFIGS, PAIR_CONFIGS, PairConfig

SCRIPT = load_script("kernels/bench_pair_cold.py")


def test_shapes_start_with_the_shipped_one_per_format() -> None:
    shapes = SCRIPT.parse_shapes(["int4=32,1,64,1,4,2,4,1,1", "int4=16,1,128,4,4,4,8,1"],
                                 ["int8", "int4"])
    assert shapes["int8"] == [PAIR_CONFIGS["int8"]]
    # the second int4 shape is the shipped one: kept once, first, then the one-token shape
    assert shapes["int4"] == [PAIR_CONFIGS["int4"], ONE_TOKEN_PAIR_CONFIGS["int4"],
                              PairConfig(32, 1, 64, 1, 4, 2, 4, factored=True, int4_words=True)]


@pytest.mark.parametrize(("text", "message"), [
    ("fp8=16,1,128,4,4,4,8", "FMT=fields with FMT one of int8, int4"),
    ("16,1,128,4,4,4,8", "FMT=fields with FMT one of int8, int4"),
    ("int4=16,1,128", "7 to 9 comma-separated fields"),
    ("int4=16,1,128,4,4,4,8,2", "factored must be 0 or 1"),
    ("int4=16,1,100,4,4,4,8", "block_n_down must be one of 16, 32, 64, 128, 256, got 100"),
])
def test_a_bad_shape_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SCRIPT.parse_shapes([text], ["int8", "int4"])


def test_layer_copies_hold_the_same_bytes_apart() -> None:
    raw = torch.arange(10, dtype=torch.uint8)
    copies = SCRIPT.layer_copies(raw, 3)
    assert len(copies) == 3 and copies[0] is raw
    assert len({c.data_ptr() for c in copies}) == 3
    assert all(torch.equal(c, raw) for c in copies)
    with pytest.raises(ValueError, match="--layers must be at least 2"):
        SCRIPT.layer_copies(raw, 1)


def test_conditions_time_one_graph_of_every_layer_and_agree() -> None:
    moe = SCRIPT.build_layer("int4", 4, 128, 64)
    raws = SCRIPT.layer_copies(host_tensor(moe.packed_groups()[0]), 2)
    seen: list[tuple[torch.dtype, list[int]]] = []
    real = SCRIPT.packed_moe

    def recording(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, raw: torch.Tensor,
                  *args: Any) -> torch.Tensor:
        seen.append((x.dtype, [raw.data_ptr()]))
        return real(x, ids, w, raw, *args)

    def timer(fn: Any, repeats: int) -> float:
        fn()
        return 3.0  # ms a graph of 2 calls

    SCRIPT.packed_moe = recording
    try:
        times = SCRIPT.time_conditions(moe, raws, PAIR_CONFIGS["int4"], 1, 2, 5, timer)
    finally:
        SCRIPT.packed_moe = real
    assert times == {"hot_bf16": 1.5, "hot_fp32": 1.5, "cold_fp32": 1.5}
    a, b = raws[0].data_ptr(), raws[1].data_ptr()
    assert seen == [(torch.bfloat16, [a]), (torch.bfloat16, [a]), (torch.float32, [a]),
                    (torch.float32, [a]), (torch.float32, [a]), (torch.float32, [b])]


def test_conditions_that_disagree_are_refused() -> None:
    moe = SCRIPT.build_layer("int8", 4, 128, 64)
    raws = SCRIPT.layer_copies(host_tensor(moe.packed_groups()[0]), 2)
    raws[1][: raws[1].numel() // 2] = 0  # another layer's bytes: not a copy

    def timer(fn: Any, repeats: int) -> float:
        fn()
        return 1.0

    with pytest.raises(AssertionError, match="the conditions' outputs differ by"):
        SCRIPT.time_conditions(moe, raws, PAIR_CONFIGS["int8"], 1, 2, 5, timer)


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "1"], "--layers must be at least 2 .a cold call needs other layers' bytes "
                        "between two reads of its own., got 1"),
    (["--tokens", "1,0"], "--tokens takes positive integers, comma-separated, got '1,0'"),
    (["--tokens", "1,x"], "--tokens takes positive integers, comma-separated, got '1,x'"),
])
def test_bad_arguments_are_named_before_any_gpu_work(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        SCRIPT.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
