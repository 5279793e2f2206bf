"""benchmarks/demo_moe/placement.py's replay on a baby model: the hit rate counts the picks whose
expert the engine's slot tables hold, and the traffic policy moves toward the picks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from bench_script import load_script

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner


def test_replay_counts_resident_picks_and_traffic_moves_toward_them(
        engine: Callable[[str, str], LLM]) -> None:
    script = load_script("demo_moe/placement.py")
    llm = engine("mixtral", "cpu")
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, llm.max_seq_len,
                         EngineConfig(gpu_expert_bytes=0))
    try:
        assert runner.overlap is not None
        moe = runner.overlap.cpu[0]
        layers = len(runner.overlap.cpu)
        total = runner.place(10**15).total_bytes
        experts = moe.num_experts
        # Every token picks experts (E-1, 0): the static plan of one expert per layer holds
        # expert 0 only, so half the picks hit.
        picks = [torch.tensor([[experts - 1, 0]] * 64) for _ in range(layers)]
        runner.place(total // experts)
        hit, moves = script.replay(runner, picks, 0)
        assert (hit, moves) == (0.5, 0)
        # Two slots per layer hold experts 0 and 1; the policy (every 16 tokens; counts read one
        # update late, halved at each) swaps expert 1 for the always-picked E-1 at token 48,
        # when E-1's 24 exceed 1.5 x 0 + MIN_EXCESS (16): from then on every pick hits.
        picks = [torch.tensor([[experts - 1, 0]] * 128) for _ in range(layers)]
        runner.place(2 * total // experts)
        hit, moves = script.replay(runner, picks, 16)
        assert moves == layers and hit == (48 * 0.5 + 80) / 128
        assert all(set(s.resident) == {0, experts - 1} for s in runner.placement.layers)
    finally:
        runner.overlap.detach()
