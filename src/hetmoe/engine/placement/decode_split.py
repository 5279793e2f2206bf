"""Decode steps that stream experts (`EngineConfig.stream_decode_rows`): a decode step of many
rows is a pass of its rows under engine/placement/expert_split.py's cost model, so the prefill
split pays there too. `decode_stream_rows` is where "auto" starts weighing it; `DecodeTuner`
weighs it against the decode path per row bucket."""

from __future__ import annotations

from collections.abc import Sequence

from hetmoe.engine.placement.expert_split import (
    EXPLORE_WITHIN,
    NEIGHBOURS,
    PrefillTuner,
    SplitCosts,
    coarse_step,
    most_misses,
    pass_seconds,
    plan_gpu_experts,
)

DECODE_GAIN = 0.7
"""`decode_stream_rows` ("auto" of `EngineConfig.stream_decode_rows`) weighs streaming a decode
step's experts only where the model expects the split at most this share of the CPU's time: a
decode step on CUDA graphs and the fused layers costs less than the model's CPU pass, and the
model leaves out a split layer's serial GPU work before its CPU share (attention, router)."""

SMALL_DECODE = 8
"""Decode steps of at most this many rows (a chat's latency-bound batches, the default CUDA graph
sizes) never weigh streaming under "auto": they stay on the decode path as they were."""


def decode_stream_rows(top_k: int, num_experts: int, costs: SplitCosts, least: int, most: int,
                       max_rows: int, resident: Sequence[int] = ()) -> int | None:
    """The fewest rows in (SMALL_DECODE, max_rows] of a decode step whose best k in [least,
    most] the model expects to take at most `DECODE_GAIN` of the CPU alone, and with at least as
    many (token, expert) pairs as experts (fewer: most copies would go unused); None: no such
    row count. Scanned upwards, at most `max_rows` model evaluations (when the runner places)."""
    for rows in range(SMALL_DECODE + 1, max_rows + 1):
        if rows * top_k < num_experts:
            continue
        k = plan_gpu_experts(rows, top_k, num_experts, costs, least, most, resident)
        alone = pass_seconds(0, rows, top_k, num_experts, costs, resident)
        if pass_seconds(k, rows, top_k, num_experts, costs, resident) <= DECODE_GAIN * alone:
            return rows
    return None


class DecodeTuner(PrefillTuner):
    """`PrefillTuner` for decode steps (`EngineConfig.stream_decode_rows`) per row bucket, where k
    = 0 is the decode path itself (CUDA graphs, fused layers, the CPU's experts: what the step
    runs otherwise), never the planner's CPU pass. A bucket's coarse round weighs the decode path,
    the model's best k >= 1 and up to `NEIGHBOURS` splits above it within `EXPLORE_WITHIN` of that
    k's expected time, `TRIES` steps each; then the prefill tuner's finer rounds around a fastest
    split (0 < k < most: neither the decode path nor the stream), within `EXPLORE_WITHIN` of the
    model's best k >= 1; then it keeps the fastest. Only steps of a bucket still being weighed are
    timed (`pick`), each as served: from its start to the next step's start, the decode path
    launched ahead (engine/executor/prefill_planner.py `DecodeClock`)."""

    least = 1
    """The decode path is no k of the model's: its choice is the best k >= 1."""

    def pick(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
             resident: Sequence[int] = (), cap: int | None = None) -> tuple[int, bool]:
        """(k for a decode step of `tokens` rows, whether the step is timed: while weighing)."""
        k, _ = super().pick(tokens, top_k, num_experts, costs, resident, cap)
        return k, not self.settled(self.bucket(tokens))

    def options(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                resident: Sequence[int] = (), cap: int | None = None) -> tuple[int, ...]:
        """The decode path (0), the model's best k >= 1, the splits above it (see the class)."""
        most = most_misses(num_experts, resident, cap)
        if most < 1:
            return (0,)  # nothing to stream
        best = plan_gpu_experts(tokens, top_k, num_experts, costs, self.least, most, resident)
        worst = EXPLORE_WITHIN * pass_seconds(best, tokens, top_k, num_experts, costs, resident)
        step = coarse_step(most)
        above = [k for k in range(best + step, min(most, best + NEIGHBOURS * step) + 1, step)
                 if pass_seconds(k, tokens, top_k, num_experts, costs, resident) <= worst]
        return (0, best, *above)
