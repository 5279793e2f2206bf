"""`deferred="auto"` (`--deferred auto`): how many experts per token Expert Deferral defers on
this machine, chosen once when the model loads, before the first request.

1. **Timing rule** (KTransformers'): defer the fewest experts that fill the CPU's idle time,
   keeping at least `MIN_IMMEDIATE` immediate. Two decode steps are timed on the loaded model
   (engine/model/deferral_probe.py): with every expert (`full_s`) and with the CPU experts masked
   out (`gpu_s`: GPU work, copies, signals). Per MoE layer the GPU runs `gpu_s / L` while the CPU
   waits, and each routed expert costs the CPU `(full_s - gpu_s) / (L K)`; deferred experts run
   during the next layer's GPU time, so d = ceil(GPU layer time / CPU expert time) fills it
   (more only moves work the CPU is busy with anyway), capped at K - `MIN_IMMEDIATE`. With
   experts resident on the GPU, only the share `cpu_share` of a token's experts costs the CPU:
   in the "score" order a deferred expert is a CPU one with that probability (the per-expert
   average above holds), in the "misses" order it always is (`(full_s - gpu_s) / (L K
   cpu_share)` each).
2. **Accuracy guard**: on a built-in probe prompt, the mean KL(exact || deferred) of the
   next-token distributions over `PROBE_STEPS` decode steps; while it passes `KL_THRESHOLD` the
   count is lowered by one, down to 0 (exact decode).

Without a GPU the choice is 0: deferral hides the CPU experts behind GPU attention, and a CPU run
computes both on the same cores. `LLM.deferral` holds the choice; the CLI prints its line at
start, and `record_deferral` keeps it for `hetmoe info MODEL`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hetmoe import env
from hetmoe.calibration import fingerprint
from hetmoe.config import DEFAULT_DEFER_ORDER
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.model.deferral_probe import (
    WARMUP_STEPS,
    KLProbe,
    step_seconds,
    without_cpu_experts,
)
from hetmoe.ops.deferral import MIN_IMMEDIATE

log = logging.getLogger(__name__)

KL_THRESHOLD = 0.05
"""Nats per decode step. On the exact model's own text, a mean KL of x raises the deferred
model's perplexity by exp(x) - 1 (5 % here); on `demo-moe` one deferred expert already costs
0.17 (docs/benchmarks/demo_moe.md), so the guard keeps that model exact."""

PROBE_STEPS = 16
"""Decode steps the guard compares (and steps timed per measurement)."""

PROBE_TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
              "type made books cheaper to copy. Within fifty years presses were working in more "
              "than two hundred cities, and")
"""The probe prompt: ordinary prose, tokenized by the model's tokenizer."""

MIN_PROBE_TOKENS = 8
"""Shortest probe prompt worth measuring (a shorter context window leaves decode exact)."""

NO_GPU = ("no GPU: deferral hides the CPU experts behind the GPU's attention, and this run "
          "computes both on the CPU")


@dataclass(frozen=True)
class StepTimes:
    """Decode step times measured on the loaded model (seconds, batch 1)."""

    full_s: float
    """A step with every routed expert computed, none deferred."""
    gpu_s: float
    """The same step with the CPU experts masked out."""
    moe_layers: int
    """MoE layers per step (L)."""
    top_k: int
    """Routed experts per token and layer (K)."""
    cpu_share: float = 1.0
    """Share of a token's routed experts the CPU computes (1 - the placement's GPU share)."""
    order: str = DEFAULT_DEFER_ORDER
    """The deferral order (`EngineConfig.defer_order`): which experts a deferral moves."""

    @property
    def gpu_layer_s(self) -> float:
        """The GPU's time per MoE layer, while the CPU waits for its inputs."""
        return self.gpu_s / self.moe_layers

    @property
    def cpu_s(self) -> float:
        """The CPU experts' share of a step."""
        return max(self.full_s - self.gpu_s, 0.0)

    @property
    def cpu_expert_s(self) -> float:
        """The CPU time one deferred expert moves under the next layer's GPU time: the average
        over a token's experts in the "score" order, one CPU expert's in "misses" (every
        deferred expert is one)."""
        share = self.cpu_share if self.order == "misses" and self.cpu_share > 0 else 1.0
        return self.cpu_s / (self.moe_layers * self.top_k * share)


MIN_CPU_SHARE = 0.05
"""Below this share of a step the CPU experts are not worth hiding: the timing rule would divide
by noise and defer the most, and deferral with next to no CPU work costs time (Qwen3-30B-A3B
shape, every expert resident: 214 tok/s exact, 176 with 3 deferred; docs/benchmarks/
gpu_experts.md, second sweep). A placement of every expert is answered before any timing
(`choose_deferred`)."""


def timed_count(times: StepTimes) -> int:
    """The timing rule: the fewest deferred experts whose CPU time fills a layer's GPU time,
    at most K - MIN_IMMEDIATE; 0 where the CPU experts are under MIN_CPU_SHARE of a step."""
    most = max(times.top_k - MIN_IMMEDIATE, 0)
    if times.cpu_s <= 0 or times.cpu_s < MIN_CPU_SHARE * times.full_s:
        return 0  # the CPU experts cost (next to) nothing: nothing to hide
    return min(most, math.ceil(times.gpu_layer_s / times.cpu_expert_s))


@dataclass(frozen=True)
class DeferralChoice:
    """What `deferred="auto"` chose and why."""

    deferred: int
    """The count decode uses (0: exact)."""
    reason: str
    """Why, in words with the measured numbers."""
    times: StepTimes | None = None
    """The step times (None: not measured, e.g. no GPU)."""
    kl: tuple[tuple[int, float], ...] = ()
    """(count, mean KL in nats) of each count the guard probed, in the order probed."""
    order: str = DEFAULT_DEFER_ORDER
    """The deferral order the count was chosen for (`EngineConfig.defer_order`)."""

    def describe(self) -> str:
        """One line for the CLI's and the server's start (the order named when it is not the
        default's and something is deferred)."""
        order = " in the score order" if self.deferred and self.order == "score" else ""
        return f"deferred auto: {self.deferred}{order} ({self.reason})"


def guarded(times: StepTimes, kl_of: Callable[[int], float],
            threshold: float = KL_THRESHOLD) -> DeferralChoice:
    """The timing rule's count, lowered while `kl_of(count)` passes `threshold`."""
    timed = timed_count(times)
    rule = (f"GPU {times.gpu_layer_s * 1e3:.3g} ms per MoE layer, CPU "
            f"{times.cpu_expert_s * 1e3:.3g} ms per expert: {timed} of top-{times.top_k} "
            f"fill the CPU's idle time, {MIN_IMMEDIATE} at least immediate")
    if timed == 0:
        return DeferralChoice(0, rule, times)
    probed: list[tuple[int, float]] = []
    for count in range(timed, 0, -1):
        probed.append((count, kl_of(count)))
        if probed[-1][1] <= threshold:
            break
    kls = ", ".join(f"{kl:.3g} at {count}" for count, kl in probed)
    chosen, kl = probed[-1]
    if kl <= threshold:
        return DeferralChoice(chosen, f"{rule}; probe KL {kls} nats <= {threshold}",
                              times, tuple(probed))
    return DeferralChoice(0, f"{rule}; probe KL {kls} nats > {threshold}: exact decode",
                          times, tuple(probed))


def choose_deferred(runner: ModelRunner, prompt: Sequence[int]) -> DeferralChoice:
    """The count for `runner` (see the module docstring), set on it (`reset_graphs`)."""
    overlap = runner.overlap
    if runner.device.type != "cuda":
        return DeferralChoice(0, NO_GPU)
    if overlap is None:
        return DeferralChoice(0, "routed experts not all in the cpu backend: nothing to overlap")
    if runner.placement is not None and runner.placement.everything:
        return DeferralChoice(0, "every routed expert resident on the GPU: no CPU work to hide")
    if overlap.top_k <= MIN_IMMEDIATE:
        return DeferralChoice(0, f"top-{overlap.top_k} routing: {MIN_IMMEDIATE} experts stay "
                                 "immediate, none is left to defer")
    room = runner.max_seq_len - PROBE_STEPS - WARMUP_STEPS
    if room < MIN_PROBE_TOKENS:
        return DeferralChoice(0, f"a {runner.max_seq_len}-token context window has no room for "
                                 f"the probe ({MIN_PROBE_TOKENS} + {PROBE_STEPS + WARMUP_STEPS} "
                                 "tokens): nothing measured")
    prompt = list(prompt)[:room]
    full = step_seconds(runner, prompt, PROBE_STEPS)
    with without_cpu_experts(runner):
        gpu = step_seconds(runner, prompt, PROBE_STEPS)
    share = 1.0 - runner.placement.plan.gpu_share() if runner.placement is not None else 1.0
    times = StepTimes(full, gpu, len(overlap.layers), overlap.top_k, share, overlap.defer_order)
    probe: list[KLProbe] = []  # made at the first count probed: no decode when timed_count is 0

    def kl_of(count: int) -> float:
        if not probe:
            probe.append(KLProbe(runner, prompt, PROBE_STEPS))
        return probe[0].kl(count)

    choice = dataclasses.replace(guarded(times, kl_of), order=overlap.defer_order)
    runner.reset_graphs(choice.deferred)
    return choice


def probe_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """`PROBE_TEXT` as token ids (a model without a tokenizer: the first 40 ids after 0)."""
    if tokenizer is None:
        return list(range(1, min(41, vocab_size)))
    return list(tokenizer.encode(PROBE_TEXT))


def record_path() -> Path:
    """Where the choices are kept for `hetmoe info` (deferral.json in hetmoe's cache dir)."""
    return env.cache_dir() / "deferral.json"


def record_deferral(model: Path, choice: DeferralChoice, device: Any) -> None:
    """Keeps `choice` as this machine's for `model` (a resolved model directory)."""
    path = record_path()
    try:
        records = _read(path)
    except ValueError as exc:  # a side record: never a reason to refuse the model
        log.warning("%s; writing a new one", exc)
        records = {}
    records[str(model.resolve())] = {"machine": fingerprint(device), "line": choice.describe(),
                           "chosen_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


def recorded_deferral(model: Path, device: Any) -> str | None:
    """The last choice kept for `model` on this machine, with its date; None: none."""
    entry = _read(record_path()).get(str(model.resolve()))
    if not isinstance(entry, dict) or entry.get("machine") != fingerprint(device):
        return None
    return f"{entry.get('line')} [chosen {entry.get('chosen_at')}]"


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable deferral record ({exc}); delete it") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a deferral record is a JSON object, found "
                         f"{type(raw).__name__}; delete it")
    return raw
