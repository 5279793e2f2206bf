"""`weighed_decode`: a decode step of many rows, as the decode path or ONE pass streaming experts.

From `EngineConfig.stream_decode_rows` rows (`PrefillPlanner.decode_rows`) the runner asks the
planner for k, how many of each layer's misses stream to the GPU: k = 0 keeps the decode path
(graphs, fused layers, launched ahead), else the step's rows run as ONE pass on the HF layers
(engine/executor/prefill_batch.py's layout of the rows alone), as a prefill pass does: never
launched ahead, no Expert Deferral. A step the planner weighs ("auto": its `DecodeTuner`) is
timed, so its decode path is not launched ahead either.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Protocol

import torch

from hetmoe.config import EngineConfig
from hetmoe.engine.executor.launch_ahead import Launched
from hetmoe.engine.executor.prefill_batch import StepLayout, step_layouts
from hetmoe.engine.executor.prefill_planner import PrefillPlanner
from hetmoe.engine.step import StepOutput, StepPlan


class WeighedRunner(Protocol):
    """What `weighed_decode` uses of the `ModelRunner` (engine/executor/runner.py): said here so
    this module does not import the runner, which imports it."""

    config: EngineConfig
    lengths: list[int]
    max_seq_len: int

    def _decode_path(self, plan: StepPlan, launched: Launched | None) -> StepOutput: ...

    def _joined(self, layout: StepLayout, logits: list[torch.Tensor], greedy: bool,
                experts: contextlib.AbstractContextManager[None] | None = None) -> StepOutput: ...

    def _after(self, out: StepOutput) -> StepOutput: ...


def weighed_decode(runner: WeighedRunner, planner: PrefillPlanner, plan: StepPlan) -> StepOutput:
    """The decode rows of `plan` (checked) on the decode path or as ONE streamed pass, as
    `planner` says (see the module docstring); the pass's k is carried out by `run_pass`."""
    rows = len(plan.slots)
    k, timed = planner.decode_experts(rows, runner.config.prefill_experts)
    tuner = planner.decode_tuner if timed else None
    with planner.run_pass(rows, k, tuner):
        if not k:
            return runner._decode_path(dataclasses.replace(plan, ahead=False) if timed else plan,
                                       None)
        layout = step_layouts(plan, runner.lengths, runner.max_seq_len)[0]  # the rows alone
        return runner._after(runner._joined(layout, [], plan.greedy, contextlib.nullcontext()))
