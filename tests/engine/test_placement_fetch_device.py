"""Fetch-or-compute on a GPU (`pytest -m device`): misses copied from the pinned host mappings on
the pool's copy stream and computed by the packed kernel equal the CPU alone; prefill, eager
batched decode and graph decode with a pool give the tokens of no pool (graph steps never
fetch: the plan needs the ids on the host)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from decode_steps import PROMPT
from test_placement import FORMAT_RTOL, _layer
from test_placement_fetch import EAGER

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.placement_fetch import StagingPool
from hetmoe.engine.placement.slots import LayerSlots, expert_bytes

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]

KERNEL_RTOL = {f: 2 * r for f, r in FORMAT_RTOL.items()} | {"bf16": 2e-2}
"""The packed kernel against the CPU backend: bf16 activations and fp32 accumulation in
another order (the CPU-device test's bf16 1e-5 is the torch path's same arithmetic)."""


@pytest.mark.parametrize("fmt", sorted(FORMAT_RTOL))
def test_fetched_misses_on_the_gpu_equal_the_cpu_alone(fmt: str) -> None:
    cuda = torch.device("cuda")
    moe = _layer(fmt)
    slots = LayerSlots(moe, [3], cuda)
    pool = StagingPool([moe], 2, EAGER, cuda)
    g = torch.Generator().manual_seed(2)
    tokens = 64
    x = torch.randn(tokens, 64, generator=g)
    ids = torch.stack([torch.full((tokens,), 5), torch.where(torch.arange(tokens) % 2 == 0, 3,
                                                               6)], 1)  # [T, 2]
    weights = torch.rand(tokens, 2, generator=g)
    xd, idd, wd = x.to(cuda), ids.to(cuda), weights.to(cuda)
    for _ in range(3):  # the pool reused: each copy waits for the last compute
        slot, cpu_ids = slots.split(idd)
        assert cpu_ids is not None
        fetched, rest = pool.take(slots, cpu_ids)
        assert fetched is not None and fetched.device.type == "cuda"
        assert rest.device.type == "cpu"  # the plan's host copy, handed on to the CPU link
        gpu = slots.compute(xd, idd, slot, wd) + pool.compute(slots, xd, idd, fetched, wd)
        ours = gpu.cpu() + moe.forward(x, rest.cpu(), weights)
        ref = moe.forward(x, ids, weights)
        err = (ours - ref).abs().max().item() / ref.abs().max().item()
        assert err <= KERNEL_RTOL[fmt], f"{fmt}: relative error {err:.3g}"
    assert (pool.steps, pool.fetched) == (3, 6)


def _decode(runner: ModelRunner, batch: int, steps: int = 3) -> list[list[int]]:
    tokens = []
    for s in range(batch):
        runner.lengths[s] = 0
        tokens.append([int(runner.prefill(s, PROMPT[: 3 + s]).argmax())])
    for _ in range(steps):
        out = runner.decode(list(range(batch)), [t[-1] for t in tokens])
        for t, row in zip(tokens, out, strict=True):
            t.append(int(row.argmax()))
    return tokens


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_with_a_pool_equals_no_pool(tiny_dir: Callable[..., Path], graphs: bool) -> None:
    llm = LLM(tiny_dir("qwen3_moe"), device="cuda", dtype="float32", experts="cpu",
              progress=False, max_seq_len=64, max_batch=4, gpu_expert_bytes=0)
    made = []
    for fetch in (0, 2):
        runner = ModelRunner(llm.model, llm.device, llm.dtype, 4, llm.max_seq_len,
                             EngineConfig(gpu_expert_bytes=0, cuda_graphs=graphs,
                                          graph_split_layer=1, prefill_experts="cpu"))
        assert runner.overlap is not None and runner.planner is not None
        runner.planner.costs = EAGER
        runner.place(2 * sum(expert_bytes(runner.overlap.cpu)), fetch_slots=fetch)
        made.append((runner, _decode(runner, 3)))
        runner.overlap.detach()
    (_, want), (runner, got) = made
    assert got == want
    pool = next(iter(runner.overlap.placed.values())).pool  # type: ignore[union-attr]
    assert pool is not None
    layers = len(runner.placement.layers)  # type: ignore[union-attr]
    # Every layer of the three prompts' prefills is planned (EAGER: least_tokens 1), then every
    # eager decode step; with graphs only the first step (run eagerly, then captured).
    decoded = 1 if graphs else 3
    assert pool.steps == (3 + decoded) * layers
    assert bool(runner.graphs) == graphs
