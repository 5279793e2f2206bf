"""`LaunchAhead`: greedy decode steps launched one ahead on CUDA graphs, and their rollback.

A greedy plan with `ahead` launches the next step of the same slots (its input the argmax on the
GPU) before this one's tokens are read, so the GPU never waits for the host. At most one step is
ahead; a plan that does not continue it (other slots, other inputs, not greedy) waits for it and
rolls its slots' lengths back, as does `settle` before anything else touches the cache. Launches
and reads go through the runner's `_launch` / `_read` (tests stand in for them without a GPU).
`sleep_until_done` waits for the GPU without spinning (the CPU experts need the cores).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hetmoe.engine.step import StepOutput, StepPlan

if TYPE_CHECKING:
    from hetmoe.engine.executor.overlap import MoEOverlap


@dataclass
class Launched:
    """A greedy decode step launched on the GPU, not yet read."""

    slots: tuple[int, ...]
    token: torch.Tensor  # [B, 1] int64 on the GPU: the argmax, the next step's input
    host: torch.Tensor  # [B, 1] pinned: its copy for the host
    done: torch.cuda.Event  # recorded after that copy
    jobs: list[Any]  # the step's flag jobs (MoEOverlap.take_pending)


class AheadRunner(Protocol):
    """What `LaunchAhead` uses of the `ModelRunner` that owns it (engine/executor/runner.py):
    said here so this module does not import the runner, which imports it."""

    device: torch.device
    max_seq_len: int
    lengths: list[int]
    overlap: MoEOverlap | None

    def _launch(self, slots: tuple[int, ...], ids: torch.Tensor) -> Launched: ...

    def _read(self, launched: Launched) -> tuple[int, ...]: ...


class LaunchAhead:
    """The step launched ahead of the caller's read, if any, of one `ModelRunner`."""

    def __init__(self, runner: AheadRunner) -> None:
        self.runner = runner
        self.step: Launched | None = None
        self.tokens: tuple[int, ...] = ()  # the inputs `step` was launched on

    def holds(self, slot: int) -> bool:
        """Whether the step launched ahead writes to `slot`."""
        return self.step is not None and slot in self.step.slots

    def take(self, plan: StepPlan) -> Launched | None:
        """The step launched ahead if `plan` continues it (same slots, its tokens as inputs, a
        greedy plan); any other is discarded."""
        ahead, self.step = self.step, None
        if ahead is not None and (ahead.slots != plan.slots or
                                  self.tokens != plan.token_ids or not plan.greedy):
            self.discard(ahead)
            ahead = None
        return ahead

    def run(self, plan: StepPlan, launched: Launched | None,
            after: Callable[[StepOutput], StepOutput]) -> StepOutput:
        """A greedy step on graphs: launched here unless `launched` continues it; the next one
        launched ahead when the plan asks and the window has room; then this one's tokens."""
        runner = self.runner
        try:
            if launched is None:
                ids = torch.tensor([[t] for t in plan.token_ids],
                                   pin_memory=runner.device.type == "cuda")
                launched = runner._launch(plan.slots, ids.to(runner.device, non_blocking=True))
            if plan.ahead and all(runner.lengths[s] < runner.max_seq_len for s in plan.slots):
                self.step = runner._launch(plan.slots, launched.token)
            tokens = runner._read(launched)
            self.tokens = tokens
            return after(StepOutput(tokens=tokens))
        except BaseException:
            self.fail(launched)
            raise

    def fail(self, launched: Launched | None) -> None:
        """After a failed step: releases the CPU jobs of `launched` and of the step launched
        ahead, and rolls their slots back (their tokens never reach the caller)."""
        inflight = [s for s in (launched, self.step) if s is not None]
        self.step = None
        self.abort(inflight)
        for slot in [s for lost in inflight for s in lost.slots]:
            self.runner.lengths[slot] -= 1

    def settle(self) -> None:
        """Waits for a step launched ahead and rolls it back (its tokens were not wanted)."""
        ahead, self.step = self.step, None
        if ahead is not None:
            self.discard(ahead)

    def discard(self, launched: Launched) -> None:
        """Waits for a step nobody will read and rolls its slots' lengths back."""
        try:
            self.runner._read(launched)
        except BaseException:
            self.abort([launched])
            raise
        finally:
            for slot in launched.slots:
                self.runner.lengths[slot] -= 1

    def abort(self, steps: list[Launched]) -> None:
        """Releases the CPU jobs of failed or abandoned launched steps."""
        if self.runner.overlap is not None:
            self.runner.overlap.abort_step([job for s in steps for job in s.jobs])


def sleep_until_done() -> None:
    """Sleeps until the current stream is done (a CUDA sync spins; the CPU experts need cores)."""
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
