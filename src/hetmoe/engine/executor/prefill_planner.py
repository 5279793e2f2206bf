"""`PrefillPlanner`: where a prefill pass runs each MoE layer's routed experts, decided once.

Its answer is k, how many of each layer's misses (experts not resident on the GPU; without a
placement every expert) a pass streams to the GPU: 0 = none (the misses on the CPU, the resident
experts on the GPU), the most misses of a layer = every miss streamed, between: split with the
CPU. It weighs the mode (`EngineConfig.prefill_experts`), this machine's per-expert costs
(engine/placement/expert_split.py's cost model over `calibration.MachineProfile`; loaded when the
runner starts, measured then when no stored profile covers them, never inside a request), the
placement's resident experts per layer, whether the GPU has room to stream (checked at the first
pass that could stream, against the memory free then) and what the passes measured
(`PrefillTuner`, per placement). `MoEOverlap` only carries a pass out (`streamed`); `hetmoe info
MODEL` prints the same plan for a model before it loads.

Decode steps of many rows are planned here too (`EngineConfig.stream_decode_rows`): from
`decode_rows` rows a decode step's k comes from `decode_experts` (in "auto" mode its own tuner,
`DecodeTuner`, whose k = 0 is the runner's decode path, timed against the planner's splits, each
step as served by `DecodeClock`), and the runner runs a step of k > 0 as a pass (`run_pass`) of
its decode rows alone.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from hetmoe.calibration import current
from hetmoe.engine.placement.decode_split import DecodeTuner, decode_stream_rows
from hetmoe.engine.placement.expert_split import (
    PrefillTuner,
    SplitCosts,
    costs_from_profile,
    describe_plan,
    most_misses,
    plan_gpu_experts,
)
from hetmoe.engine.placement.placement_plan import PlacementPlan
from hetmoe.engine.placement.slots import Placement

if TYPE_CHECKING:
    from hetmoe.engine.executor.overlap import MoEOverlap
    from hetmoe.experts.cpu_moe import CpuMoE

log = logging.getLogger(__name__)

NEVER = sys.maxsize
"""`PrefillPlanner.decode_rows` when no decode step streams."""


def check_prefill_mode(mode: str, device: torch.device) -> None:
    """ValueError when `mode` (EngineConfig.prefill_experts) needs a GPU this run lacks."""
    if mode in ("gpu", "split") and device.type != "cuda":
        raise ValueError(f"option prefill_experts={mode!r} computes experts on a GPU; this run "
                         f"is on {device.type} (use 'auto' or 'cpu')")


def needs_costs(gpu: bool, mode: str, fetch_slots: int) -> bool:
    """Whether a runner loads this machine's costs when it starts: a GPU prefill may split or be
    chosen by them (`mode` "auto" or "split"; stream_decode_rows "auto" weighs only in those
    modes), or fetch-or-compute plans with them."""
    return gpu and mode in ("auto", "split") or fetch_slots > 0


def load_costs(moe: CpuMoE, device: torch.device) -> SplitCosts:
    """Per-expert costs of `moe`'s layer shape and format on this machine: the stored profile,
    or measured now (seconds, logged) when none covers them, as `hetmoe calibrate` would."""
    costs = costs_from_profile(current(device, formats=(moe.weight_format,)), moe)
    log.info("prefill costs per expert on this machine: %s", costs)
    return costs


class DecodeClock:
    """Times the decode steps `DecodeTuner` weighs from one step's start to the next step's start
    of the same rows, so every k pays the host's time between steps as served: the decode path's
    launched ahead (hidden behind the GPU), a streamed step's not (engine/executor/
    weighed_decode.py runs them). A timed step whose rows changed before the next step (another
    step, a prefill between) is not recorded."""

    def __init__(self) -> None:
        self.pending: tuple[tuple[int, ...], int, float] | None = None
        """(slots, k, start) of the timed step the next step's start ends."""
        self.lengths: tuple[int, ...] = ()  # the pending step's slots' lengths after it
        self.turn = False
        """Whether the next step, launched ahead by a weighed decode-path step, is timed."""

    def start(self, slots: tuple[int, ...], lengths: list[int], tuner: DecodeTuner) -> float:
        """A decode step of `slots` starts now (returned): the pending step's time into `tuner`
        when this step follows it directly."""
        now = time.perf_counter()
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == slots and \
                tuple(lengths[s] for s in slots) == self.lengths:
            tuner.record(len(slots), pending[1], now - pending[2])
        return now

    def timed(self, slots: tuple[int, ...], k: int, start: float, lengths: list[int]) -> None:
        """The step of `slots` started at `start` ran k: timed up to the next step's start."""
        self.pending, self.lengths = (slots, k, start), tuple(lengths[s] for s in slots)

    def interrupt(self) -> None:
        """Something else ran between decode steps (a prefill pass): no step is timed across it."""
        self.pending, self.turn = None, False


class PrefillPlanner:
    """Where prefill passes of a model with `layers` MoE layers of `num_experts` experts (top
    `top_k`) run their routed experts (see the module docstring). `costs`: this machine's, or
    None until `load_costs`; `refusal`: why the GPU cannot stream now ("" if it can; None: no GPU
    to stream to); `loader`: the costs' source for `load_costs`; `cap`: the most misses per
    layer the staging holds, asked once the GPU can stream (engine/placement/staging_plan.py;
    None: every miss)."""

    def __init__(self, num_experts: int, top_k: int, layers: int,
                 costs: SplitCosts | None = None,
                 refusal: Callable[[], str] | None = None,
                 loader: Callable[[], SplitCosts] | None = None,
                 cap: Callable[[], int] | None = None) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.costs = costs
        self.layers = layers
        self.placement: Placement | PlacementPlan | None = None
        """Experts resident on the GPU (`place`): the runner's, or a plan (`hetmoe info`)."""
        self.tuner = PrefillTuner()
        """Measured passes ("auto"), of the current placement."""
        self.decode_tuner = DecodeTuner()
        """Measured decode steps of `decode_rows` rows or more ("auto"), of the placement."""
        self.decode_clock = DecodeClock()
        """Times the weighed decode steps for `decode_tuner`."""
        self.decode_rows = NEVER
        """The fewest rows of a decode step that `decode_experts` plans (`prepare`)."""
        self.stream_refusal: str | None = None  # "" streams; None: not checked yet
        self.stream_cap: int | None = None
        """Misses per layer a pass may stream (`cap`, read by `can_stream`; None: all)."""
        self._cap = cap
        self.overlap: MoEOverlap | None = None
        """The MoE step whose passes this plans (`for_overlap`; None: a plan on paper)."""
        self._refusal = refusal
        self._loader = loader

    @classmethod
    def for_overlap(cls, overlap: MoEOverlap) -> PrefillPlanner:
        """The planner of `overlap`'s layers; `prepare` loads its costs once it is placed."""
        planner = cls(overlap.cpu[0].num_experts, overlap.top_k, len(overlap.cpu),
                      refusal=overlap.streaming_refusal if overlap.host else None,
                      loader=lambda: load_costs(overlap.cpu[0], overlap.device),
                      cap=overlap.stream_cap if overlap.host else None)
        planner.overlap = overlap
        return planner

    def prepare(self, mode: str, fetch_slots: int, decode_rows: int | str = 0,
                max_rows: int = 0) -> None:
        """Loads the costs when passes of the current placement plan with them (`needs_costs`;
        call when the runner starts or places, never inside a request), and sets `decode_rows`
        from `decode_rows` (EngineConfig.stream_decode_rows) for steps of at most `max_rows`
        rows ("auto" weighs only in modes "auto" and "split": "gpu" would stream every miss,
        a row count asks for that). Not when every expert is resident: no CPU expert work and
        nothing to stream, so nothing to weigh."""
        gpu = self._refusal is not None
        if self.everything:
            log.info("prefill: every routed expert is resident on the GPU (no CPU expert work, "
                     "nothing to stream): no prefill costs loaded")
            return
        if needs_costs(gpu, mode, fetch_slots):
            self.load_costs()
        if not gpu or mode == "cpu" or not decode_rows or (decode_rows == "auto" and mode == "gpu"):
            self.decode_rows = NEVER
        elif isinstance(decode_rows, int):
            self.decode_rows = decode_rows
        else:
            self.decode_rows = self._auto_decode_rows(mode, max_rows)
            log.info("decode steps of %s rows weigh streaming experts to the GPU", "no" if
                     self.decode_rows == NEVER else f"{self.decode_rows} or more")

    def _auto_decode_rows(self, mode: str, max_rows: int) -> int:
        """`decode_rows` of "auto": where the model expects `mode`'s k to pay (expert_split.py
        `decode_stream_rows`)."""
        most = max(1, self.misses - 1) if mode == "split" else self.misses
        rows = decode_stream_rows(self.top_k, self.num_experts, self._costs(mode), 1, most,
                                  max_rows, self.resident)
        return NEVER if rows is None else rows

    def load_costs(self) -> SplitCosts:
        """The costs, loaded (or measured) through the loader when not there yet; call when the
        runner starts or between steps, never inside a request."""
        if self.costs is None:
            if self._loader is None:
                raise ValueError("PrefillPlanner: no costs and no loader for them")
            self.costs = self._loader()
        return self.costs

    def place(self, placement: Placement | PlacementPlan | None) -> None:
        """A new placement (None: every expert on the CPU): the tuner starts again (its timings
        were of the old one) and the room to stream is checked again at the next pass."""
        layers = None if placement is None else (
            len(placement.layers) if isinstance(placement, Placement) else
            len(placement.resident))
        if layers is not None and layers != self.layers:
            raise ValueError(f"PrefillPlanner: a placement of {layers} MoE layers for a model "
                             f"of {self.layers}")
        self.placement = placement
        self.tuner, self.decode_tuner, self.decode_rows = PrefillTuner(), DecodeTuner(), NEVER
        self.decode_clock = DecodeClock()  # a step of the old placement times nothing
        self.stream_refusal, self.stream_cap = None, None

    @property
    def resident(self) -> tuple[int, ...]:
        """Experts resident on the GPU per MoE layer now (a slot being filled holds none)."""
        if isinstance(self.placement, Placement):
            return tuple(len(slots.experts()) for slots in self.placement.layers)
        if isinstance(self.placement, PlacementPlan):
            return tuple(len(ids) for ids in self.placement.resident)
        return (0,) * self.layers

    @property
    def everything(self) -> bool:
        """Whether every expert is resident (nothing to stream)."""
        return self.placement is not None and self.placement.everything

    def can_stream(self) -> bool:
        """Whether prefill can stream these experts to the GPU (checked once per placement; a
        refusal is logged as a warning, and prefill stays on the CPU)."""
        if self._refusal is None:
            return False
        if self.stream_refusal is None:
            self.stream_refusal = self._refusal()
            if self.stream_refusal:
                log.warning("%s: long prompts prefill on the CPU", self.stream_refusal)
            elif self._cap is not None:
                self.stream_cap = self._cap()
        return not self.stream_refusal

    @property
    def misses(self) -> int:
        """The k that streams every miss of every layer."""
        return most_misses(self.num_experts, self.resident)

    @property
    def most(self) -> int:
        """The largest k a pass may take: every miss, or as many as the staging holds."""
        return self.misses if self.stream_cap is None else min(self.misses, self.stream_cap)

    def _costs(self, mode: str) -> SplitCosts:
        if self.costs is None:
            raise RuntimeError(f"prefill_experts={mode!r} plans with this machine's costs, which "
                               "were not loaded when the runner started (PrefillPlanner."
                               "load_costs)")
        return self.costs

    def gpu_experts(self, tokens: int, mode: str = "auto") -> int:
        """k for a pass of `tokens` tokens (see the module docstring). `mode`: "cpu", "gpu",
        "split" (the best k in [1, misses - 1]; 1 when a layer has at most one miss) or "auto"
        (the best k in [0, misses], the tuner's measurements deciding between close rivals).
        When every expert is resident nothing is streamed."""
        return self._pick(tokens, mode)[0]

    def decode_experts(self, rows: int, mode: str = "auto") -> tuple[int, bool]:
        """(k, whether the step is timed for `decode_tuner`) of a decode step of `rows` rows
        (at least `decode_rows`): as `gpu_experts` in modes "cpu", "gpu" and "split"; in "auto"
        `decode_tuner`'s, whose 0 is the runner's decode path (see the module docstring)."""
        return self._pick(rows, mode, self.decode_tuner)

    def _pick(self, tokens: int, mode: str,
              tuner: PrefillTuner | None = None) -> tuple[int, bool]:
        """(`gpu_experts`' k, whether the tuner reads the pass's time: "auto" between rivals);
        `tuner`: "auto"'s (None: the prefill passes')."""
        if self.everything or mode == "cpu" or not self.can_stream():
            return 0, False
        if mode == "gpu":
            return self.most, False
        if mode == "split":  # a cap below the misses is a split already
            top = self.most if self.most < self.misses else max(1, self.most - 1)
            return plan_gpu_experts(tokens, self.top_k, self.num_experts, self._costs(mode), 1,
                                    top, self.resident), False
        return (tuner or self.tuner).pick(tokens, self.top_k, self.num_experts,
                                          self._costs(mode), self.resident, self.stream_cap)

    def describe(self, k: int) -> str:
        """A pass's k in words, the resident experts counted."""
        resident = max(self.resident, default=0)
        if self.everything:
            return "GPU (every expert resident)"
        held = ", all the staging holds" if 0 < k == self.most < self.misses else ""
        if not resident:
            return describe_plan(k, self.num_experts) + (f" ({held[2:]})" if held else "")
        on_gpu = f"{resident} resident experts per layer on the GPU"
        if k == 0:
            return f"CPU ({on_gpu})"
        if k >= self.misses:
            return f"GPU stream ({on_gpu})"
        return (f"split ({k} of {self.misses} misses per layer streamed to the GPU{held}; "
                f"{on_gpu})")

    @contextmanager
    def prefill_pass(self, tokens: int, mode: str = "auto") -> Iterator[None]:
        """A prefill pass of `tokens` tokens with its routed experts where `gpu_experts` puts
        them (the overlap streams them); a pass whose k the tuner's measurements decide ("auto"
        between close rivals, on a GPU) is timed to its last GPU work for the tuner. Other
        passes are not: their time is never read, and timing costs a GPU sync."""
        if self.overlap is None:
            raise ValueError("PrefillPlanner.prefill_pass: a planner without a MoE step "
                             "(made by for_overlap) plans on paper only")
        self.decode_clock.interrupt()
        k, timed = self._pick(tokens, mode)
        with self.run_pass(tokens, k, self.tuner if timed else None):
            yield

    @contextmanager
    def run_pass(self, tokens: int, k: int, tuner: PrefillTuner | None = None
                 ) -> Iterator[None]:
        """A pass of `tokens` tokens streaming k misses per layer (0: none streamed), timed to
        its last GPU work into `tuner` when one is given; the CPU jobs the pass started in
        stream order (engine/placement/layer_stream.py) are waited at its end."""
        overlap = self.overlap
        if overlap is None:
            raise ValueError("PrefillPlanner.run_pass: a planner without a MoE step "
                             "(made by for_overlap) plans on paper only")
        if k:
            overlap.make_streamer()  # made (host memory registered) before the pass is timed
        start = time.perf_counter()
        try:
            with overlap.streamed(tokens, k) if k else contextlib.nullcontext():
                yield
            if overlap.pending:  # the CPU's shares started in stream order (host links)
                done = torch.cuda.Event(blocking=True)  # sleep, not spin: the pool's cores
                done.record()
                done.synchronize()
                overlap.finish_step()
        except BaseException:
            if overlap.pending:
                overlap.abort_step()  # queued CPU jobs must not wait for a lost pass
            raise
        if tuner is not None:
            torch.cuda.synchronize(overlap.device)
            tuner.record(tokens, k, time.perf_counter() - start)
