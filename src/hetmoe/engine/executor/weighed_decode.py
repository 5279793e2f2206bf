"""`weighed_decode`: a decode step of many rows, as the decode path or ONE pass streaming experts.

From `EngineConfig.stream_decode_rows` rows (`PrefillPlanner.decode_rows`) the runner asks the
planner for k, how many of each layer's misses stream to the GPU: k = 0 keeps the decode path
(graphs, fused layers, launched ahead), else the step's rows run as ONE pass on the HF layers
(engine/executor/prefill_batch.py's layout of the rows alone), as a prefill pass does: never
launched ahead, no Expert Deferral. A step the planner weighs ("auto": its `DecodeTuner`) runs
as served and is timed by the planner's `DecodeClock`, from its start to the next step's start
(the host's time between steps counted for every k, no GPU sync): a streamed step on its own; a
decode-path turn is two steps, the first launching the second ahead as served, and the second
(launching nothing, so the planner is asked at the next step) is the one timed.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Protocol

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.launch_ahead import LaunchAhead, Launched
from hetmoe.engine.executor.prefill_batch import StepLayout, step_layouts
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.step import StepOutput, StepPlan


class WeighedRunner(Protocol):
    """What `weighed_decode` uses of the `ModelRunner` (engine/executor/runner.py): said here so
    this module does not import the runner, which imports it."""

    config: EngineConfig
    lengths: list[int]
    max_seq_len: int
    launch_ahead: LaunchAhead

    def _decode_path(self, plan: StepPlan, launched: Launched | None) -> StepOutput: ...

    def _joined(self, layout: StepLayout, logits: list[torch.Tensor], greedy: bool,
                experts: contextlib.AbstractContextManager[None] | None = None) -> StepOutput: ...

    def _after(self, out: StepOutput) -> StepOutput: ...


def weighed_decode(runner: WeighedRunner, planner: PrefillPlanner, plan: StepPlan,
                   launched: Launched | None) -> StepOutput:
    """The decode rows of `plan` (checked) on the decode path or as ONE streamed pass, as
    `planner` says (see the module docstring); the pass's k is carried out by `run_pass`.
    `launched`: the step launched ahead that `plan` continues (the decode path, not asked)."""
    clock = planner.decode_clock
    start = clock.start(plan.slots, runner.lengths, planner.decode_tuner)
    turn, clock.turn = clock.turn, False
    if launched is not None:  # a decode-path step launched ahead: timed when a turn's second
        out = runner._decode_path(dataclasses.replace(plan, ahead=False) if turn else plan,
                                  launched)
        if turn:
            clock.timed(plan.slots, 0, start, runner.lengths)
        return out
    rows = len(plan.slots)
    k, timed = planner.decode_experts(rows, runner.config.prefill_experts)
    if not k:
        out = runner._decode_path(plan, None)
    else:
        layout = step_layouts(plan, runner.lengths, runner.max_seq_len)[0]  # the rows alone
        with planner.run_pass(rows, k):
            out = runner._after(runner._joined(layout, [], plan.greedy, contextlib.nullcontext()))
    if timed and not k and runner.launch_ahead.step is not None:
        clock.turn = True  # the step launched ahead is the turn's timed one
    elif timed:
        clock.timed(plan.slots, k, start, runner.lengths)
    return out
