"""benchmarks/kernels/bench_packed_moe.py draws its inputs in one place: the main table, the tile
sweep and the pair sweep time the same tokens, routes and weights at the same T."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from bench_script import load_script

SCRIPT = load_script("kernels/bench_packed_moe.py")
CPU = torch.device("cpu")


def test_inputs_are_seeded_by_t_with_distinct_experts_per_token() -> None:
    x, ids, weights = SCRIPT.inputs(8, 16, 12, 3, CPU)
    assert (x.shape, x.dtype, ids.shape, weights.shape) == ((8, 16), torch.bfloat16, (8, 3),
                                                            (8, 3))
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert int(ids.min()) >= 0 and int(ids.max()) < 12
    assert float(weights.min()) >= 0 and float(weights.max()) < 1
    again = SCRIPT.inputs(8, 16, 12, 3, CPU)
    assert all(torch.equal(a, b) for a, b in zip((x, ids, weights), again, strict=True))
    other = SCRIPT.inputs(9, 16, 12, 3, CPU)
    assert not torch.equal(other[0][:8], x)


class Drawn(Exception):
    """Raised by the stand-in input maker once a table asked it for inputs."""


def test_every_table_draws_through_the_one_input_maker(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[Any, ...]] = []

    def maker(*args: Any) -> Any:
        asked.append(args)
        raise Drawn

    monkeypatch.setattr(SCRIPT, "inputs", maker)
    part = SimpleNamespace(expert_bytes=100)
    moe = SimpleNamespace(packed_groups=lambda: (part,), weight_format="int8", num_experts=12,
                          hidden=16, intermediate=24, group_size=32)
    raw = torch.zeros(4)
    for table in (lambda: SCRIPT.time_tokens(moe, raw, 5, 3, 1e9, 2),
                  lambda: SCRIPT.sweep(moe, raw, [5], 3, 2),
                  lambda: SCRIPT.pair_sweep(moe, raw, [5], 3, 1e9, 2)):
        with pytest.raises(Drawn):
            table()
    assert asked == [(5, 16, 12, 3, raw.device)] * 3
