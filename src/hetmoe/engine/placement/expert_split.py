"""Where a prefill pass runs each MoE layer's routed experts: the CPU, the GPU, or both at once.

A pass of T tokens gives each layer P = T * top_k (token, slot) pairs. Of a layer's E experts, r
are resident on the GPU (a placement, engine/placement/slots.py: computed from their slots, never
copied); the GPU also computes k of the E - r misses, their packed bytes copied over PCIe ahead
of use (layer i + 2's copy during layer i's compute: the copy does not wait for the router, so
both sides work from the start of a layer); the CPU computes the other E - r - k misses of the
same layer at the same time. k = E - r streams every miss (the CPU idles), k = 0 leaves the
misses to the CPU (no copy; the resident experts still run on the GPU).

Per layer, with an even spread of the pairs (n = P / E per expert; an expert of the CPU's share
costs its fixed part only if some pair chose it: probability a = 1 - (1 - 1/E)^P):

    copy(k) = k * gpu_expert                               (the copy engine, ahead of use)
    GPU(k)  = (r + k) * (gpu_fixed + n * gpu_token)        (unpack, grouped GEMM)
    CPU(k)  = cpu_call + (E - r - k) * (a * cpu_fixed + n * cpu_token)

    k = E - r:   max(copy(k), GPU(k))                       (no CPU share)
    r = k = 0:   CPU(0)                                     (no GPU share)
    otherwise:   max(copy(k), split_fixed + T * split_token + max(CPU(k), GPU(k)))

(a split layer's round trip, its activations to the host and the CPU's sum back, is serial with
both sides). A pass takes one k for every layer, each layer streaming at most its own misses;
`plan_gpu_experts` takes the k of the smallest sum over the layers. The costs come from this
machine's measured rates (`costs_from_profile`, hetmoe.calibration), so where the GPU starts to
pay off is measured, not a constant. A decode step of many rows is such a pass of its rows
(engine/placement/decode_split.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hetmoe.calibration import MachineProfile
    from hetmoe.experts.cpu_moe import CpuMoE


@dataclass(frozen=True)
class SplitCosts:
    """Seconds of each side's work in one MoE layer (see the module docstring)."""

    cpu_fixed: float
    """CPU: one expert's packed weights read from memory."""
    cpu_token: float
    """CPU: each (token, expert) pair's products."""
    gpu_expert: float
    """GPU: one expert's packed bytes copied over PCIe."""
    gpu_token: float = 0.0
    """GPU: each (token, expert) pair's products (grouped GEMM)."""
    gpu_fixed: float = 0.0
    """GPU: one expert's unpack to bf16."""
    cpu_call: float = 0.0
    """CPU: a layer's call beyond its experts (job start, barriers)."""
    split_fixed: float = 0.0
    """A split layer: the hand-off from the router to the CPU's share (its ready word)."""
    split_token: float = 0.0
    """A split layer: each token's activations to the host and the CPU's sum back."""


def layer_seconds(k: int, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                  resident: int = 0) -> float:
    """Expected seconds of one layer with `resident` experts resident on the GPU and `k` of
    its misses streamed there, the other misses on the CPU, for `tokens` tokens spread evenly
    (the later side)."""
    if not 0 <= resident <= num_experts:
        raise ValueError(f"resident experts must be in [0, {num_experts}], got {resident}")
    if not 0 <= k <= num_experts - resident:
        raise ValueError(f"k must be in [0, {num_experts - resident}], got {k}")
    pairs = tokens * top_k
    n = pairs / num_experts
    active = 1.0 - (1.0 - 1.0 / num_experts) ** pairs
    rest = num_experts - resident - k  # the CPU's experts
    copy = k * costs.gpu_expert
    gpu = (resident + k) * (costs.gpu_fixed + n * costs.gpu_token)
    cpu = costs.cpu_call + rest * (active * costs.cpu_fixed + n * costs.cpu_token)
    if rest == 0:
        return max(copy, gpu)
    if resident + k == 0:
        return cpu
    return max(copy, costs.split_fixed + tokens * costs.split_token + max(cpu, gpu))


def most_misses(num_experts: int, resident: Sequence[int] = (), cap: int | None = None) -> int:
    """The largest count of non-resident experts over the layers (`resident`: per layer; none
    given: no placement, E), at most `cap` (a staging's): the k that streams every miss."""
    most = num_experts - min(resident, default=0)
    return most if cap is None else min(most, cap)


def pass_seconds(k: int, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                 resident: Sequence[int] = ()) -> float:
    """Expected seconds of a pass's MoE layers, each streaming min(k, its misses) experts
    (`resident`: resident experts per layer; none given: one layer without a placement)."""
    layers = Counter(resident) if resident else Counter([0])
    return sum(count * layer_seconds(min(k, num_experts - r), tokens, top_k, num_experts, costs, r)
               for r, count in layers.items())


def plan_gpu_experts(tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                     least: int = 0, most: int | None = None,
                     resident: Sequence[int] = ()) -> int:
    """The k in [least, most] (default [0, the most misses of a layer]) of the fewest expected
    seconds per pass: how many of each layer's misses (experts not resident, `resident` per
    layer) a pass of `tokens` tokens streams to the GPU. Ties go to the smaller k (fewer bytes
    over PCIe)."""
    top = most_misses(num_experts, resident)
    most = top if most is None else most
    if not 0 <= least <= most <= top:
        raise ValueError(f"need 0 <= least <= most <= {top}, got {least}, {most}")
    return min(range(least, most + 1),
               key=lambda k: (pass_seconds(k, tokens, top_k, num_experts, costs, resident), k))


def costs_from_profile(profile: MachineProfile, moe: CpuMoE) -> SplitCosts:
    """Per-expert costs of `moe`'s layer shape and format from this machine's measured rates.
    ValueError when the profile has no GPU copy rate or no CPU rate for the format."""
    expert_bytes = sum(p.expert_bytes for p in moe.packed_groups())
    return layer_costs(profile, moe.weight_format, moe.hidden, moe.intermediate, expert_bytes)


def layer_costs(profile: MachineProfile, fmt: str, hidden: int, intermediate: int,
                expert_bytes: int) -> SplitCosts:
    """`costs_from_profile` for a layer of `fmt` experts of hidden x intermediate taking
    `expert_bytes` each when packed (`hetmoe info` plans a model it has not loaded)."""
    if profile.h2d_bytes_s is None:
        raise ValueError("the machine profile has no host-to-GPU copy rate (measured without "
                         "a GPU): run `hetmoe calibrate --device cuda`")
    if fmt not in profile.cpu_flops or fmt not in profile.cpu_expert_bytes_s:
        raise ValueError(f"the machine profile has no CPU rate for {fmt} experts: run "
                         f"`hetmoe calibrate --formats {fmt}`")
    flops = 6.0 * hidden * intermediate  # per (token, expert) pair
    gpu_rate = (profile.gpu_flops or {}).get(fmt)
    unpack = (profile.gpu_expert_bytes_s or {}).get(fmt)
    return SplitCosts(
        cpu_fixed=expert_bytes / profile.cpu_expert_bytes_s[fmt],
        cpu_token=flops / profile.cpu_flops[fmt],
        gpu_expert=expert_bytes / profile.h2d_bytes_s,
        gpu_token=flops / gpu_rate if gpu_rate else 0.0,
        gpu_fixed=expert_bytes / unpack if unpack else 0.0,
        cpu_call=profile.cpu_call_s,
        # The CPU's share starts on a ready word after the router as a pool call starts its
        # workers (a proxy: one hand-off each way); activations cross to the host by copy
        # (bf16), the CPU's sum is read in place by the GPU's add.
        split_fixed=profile.cpu_call_s,
        split_token=2 * hidden * (1 / (profile.d2h_bytes_s or profile.h2d_bytes_s)
                                  + 1 / (profile.gpu_host_read_bytes_s or profile.h2d_bytes_s)),
    )


def describe_plan(k: int, num_experts: int) -> str:
    """A plan's k in words (without a placement)."""
    if k == 0:
        return "CPU"
    if k == num_experts:
        return "GPU stream"
    return f"split ({k} of {num_experts} experts on the GPU)"


EXPLORE_WITHIN = 1.5
"""`PrefillTuner` times an alternative to the model's choice only when the model predicts it
within this factor of the choice (its largest measured error so far is 1.3x: round 3 in
docs/benchmarks/prefill.md's git history): a 1-token prompt never tries streaming every expert."""

TRIES = 2
"""Passes each k `PrefillTuner` weighs gets in a length bucket before the fastest is kept: the
first pass of a k may carry one-time costs (pinned buffers, kernel selection)."""

NEIGHBOURS = 3
"""Splits above the weighed split that `PrefillTuner` also times in a bucket's coarse round, a
sixteenth of the most misses apart (128 experts: k + 8, k + 16, k + 24). The model leaves out the
GPU work a split layer waits for in series (attention and router before the CPU starts; the next
layer waits for the CPU's sum), so the best split lies at or above its k (INT4 at 512 tokens on
H200 boxes, the CPU's share started in stream order: the model's k 80-89, the best measured 90-94;
with a host wait per layer before, 92 against 108). The finer rounds look between the points."""

CLIMB_ROUNDS = 4
"""Rounds after a bucket's coarse one while its fastest split is the highest split it weighed, each
one coarse step higher (below the most misses), at most this many, before the finer rounds: the
model's CPU costs come from calls alone, so where they are low it puts its k and the neighbours
above far under the best (INT4 at 512 tokens, one H200 box: the time fell with k up to 110 while the
model's k was in the 80s; on another box, with lower measured CPU costs, the tuner's pick was 78). A
climb is measured better at every step, so `EXPLORE_WITHIN` does not bound it."""

FINER_ROUNDS = 3
"""Rounds after a bucket's coarse one, each at half the last step around the fastest split so far
(128 experts: k -/+ 4, 2, then 1); at most this many: the finest step is 1 up to 255 experts."""

EXPLORE_PASSES = TRIES * (2 + NEIGHBOURS + CLIMB_ROUNDS + 2 * FINER_ROUNDS)
"""The most passes a length bucket takes before its k is settled (benchmarks run these first)."""


def coarse_step(most: int) -> int:
    """The coarse round's step between splits: a sixteenth of the most misses (128 experts: 8)."""
    return max(1, most // 16)


def finer_steps(most: int) -> tuple[int, ...]:
    """The half steps of a bucket's finer rounds, in turn (128 experts: 4, 2, 1)."""
    step = coarse_step(most)
    return tuple(step >> i for i in range(1, FINER_ROUNDS + 1) if step >> i)


class PrefillTuner:
    """Measured prefill seconds per token of each weighed k per prompt-length bucket (a power of
    two). In a new bucket's coarse round the model's k, its most likely rival of another strategy
    (the stream if the model split, its best split if it streamed or stayed on the CPU; with at
    most one miss per layer, no split: the other one) and up to `NEIGHBOURS` splits above the
    split of the two take turns, `TRIES` passes each. While a round's fastest is the highest
    split weighed, a climb round weighs one a coarse step above (`CLIMB_ROUNDS`); then finer
    rounds weigh the ks half the last step below and above the fastest split (new ones, within
    [1, most - 1]; `FINER_ROUNDS`); the k of the best pass of them all is kept. Only ks the model
    predicts within `EXPLORE_WITHIN` of its choice are weighed (climbs aside). The cost model
    ranks; what this machine measured decides. Passes with fewer (token, expert) pairs than
    experts (a chat turn's few new tokens) keep the model's pick: no rival there could pay for
    experts copied ahead that no token uses. A rival the model finds far slower is not weighed,
    a split's neighbours still are (the model's CPU costs are of calls alone: one H200 box kept
    its INT4 split at 512 tokens untimed at k = 78, where others measured their best at 99-110).
    Only passes whose k measurements decide are timed (`pick`): a pass the model alone decides
    costs no GPU sync. Its timings are of one placement: `PrefillPlanner.place` starts a new
    tuner."""

    least = 0
    """The least k the model may choose (`EXPLORE_WITHIN` counts from that choice's time)."""

    def __init__(self) -> None:
        self.measured: dict[int, dict[int, list[float]]] = {}
        """bucket -> {k: seconds per token of each of its passes}"""
        self.weighed: dict[int, tuple[int, ...]] = {}
        """bucket -> the ks it weighs, in turn order: the coarse round (fixed by its first
        weighed pass), then each finer round's once the one before has settled"""
        self.finer: dict[int, tuple[int, ...]] = {}
        """bucket -> the half steps of its finer rounds to come (none: no more)"""
        self.climbs: dict[int, int] = {}
        """bucket -> the climb rounds it has left (`CLIMB_ROUNDS`)"""

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(1, tokens).bit_length()

    def choose(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
               resident: Sequence[int] = (), cap: int | None = None) -> int:
        """The k for a pass of `tokens` tokens (see the class docstring); `resident`: resident
        experts per layer (none given: no placement); `cap`: the most misses a pass may stream
        per layer (the staging's, engine/placement/staging_plan.py; None: every miss)."""
        return self.pick(tokens, top_k, num_experts, costs, resident, cap)[0]

    def pick(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
             resident: Sequence[int] = (), cap: int | None = None) -> tuple[int, bool]:
        """(`choose`'s k, whether measurements decide it): only such a pass's time is read, so
        only such a pass needs timing (`record`). A capped pass's most is its "stream"."""
        bucket = self.bucket(tokens)
        if bucket not in self.weighed:
            options = self.options(tokens, top_k, num_experts, costs, resident, cap)
            if len(options) == 1:
                return options[0], False
            self.weighed[bucket] = options
            self.finer[bucket] = finer_steps(most_misses(num_experts, resident, cap))
        if self.round_settled(bucket) and self.finer.get(bucket):
            self.refine(bucket, tokens, top_k, num_experts, costs, resident, cap)
        if not self.round_settled(bucket):
            times = self.measured.get(bucket, {})
            return min(self.weighed[bucket], key=lambda k: len(times.get(k, []))), True
        return self.fastest(bucket), True

    def round_settled(self, bucket: int) -> bool:
        """Whether every k `bucket` weighs so far has its `TRIES` timings."""
        times = self.measured.get(bucket, {})
        return all(len(times.get(k, [])) >= TRIES for k in self.weighed.get(bucket, ()))

    def settled(self, bucket: int) -> bool:
        """Whether `bucket`'s last round has settled (one weighing nothing has)."""
        return self.round_settled(bucket) and not self.finer.get(bucket)

    def fastest(self, bucket: int) -> int:
        """The k of `bucket`'s timed ks with the fastest timing (ties: the earlier option)."""
        times = self.measured[bucket]
        return min(self.weighed[bucket], key=lambda k: min(times[k]))

    def refine(self, bucket: int, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
               resident: Sequence[int] = (), cap: int | None = None) -> None:
        """After a settled round: a climb round while the fastest split is the highest weighed
        (`CLIMB_ROUNDS`), else the next finer round with new ks around it (a round without goes
        finer at once); no more rounds when none has or it is no split."""
        best, most = self.fastest(bucket), most_misses(num_experts, resident, cap)
        if not 0 < best < most:
            self.finer.pop(bucket, None)
            return  # the CPU or the stream: no split to look around
        if self.climb(bucket, best, most):
            return
        steps = self.finer.pop(bucket, ())
        model = plan_gpu_experts(tokens, top_k, num_experts, costs, self.least, most, resident)
        # A climbed bucket's bound counts from its best (the climbs went past the model's).
        bases = (model, best) if bucket in self.climbs else (model,)
        worst = EXPLORE_WITHIN * max(pass_seconds(k, tokens, top_k, num_experts, costs, resident)
                                     for k in bases)
        for i, half in enumerate(steps):
            new = [k for k in dict.fromkeys(min(max(best + d, 1), most - 1) for d in (-half, half))
                   if k not in self.weighed[bucket]
                   and pass_seconds(k, tokens, top_k, num_experts, costs, resident) <= worst]
            if new:
                self.weighed[bucket] += tuple(new)
                self.finer[bucket] = steps[i + 1:]
                return

    def climb(self, bucket: int, best: int, most: int) -> bool:
        """Adds the split a coarse step above `best` when `best` is the highest split weighed and
        climb rounds are left (`CLIMB_ROUNDS`); whether it did."""
        left, up = self.climbs.get(bucket, CLIMB_ROUNDS), best + coarse_step(most)
        if not left or up >= most or best != max(k for k in self.weighed[bucket] if k < most):
            return False
        self.weighed[bucket] += (up,)
        self.climbs[bucket] = left - 1
        return True

    def options(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                resident: Sequence[int] = (), cap: int | None = None) -> tuple[int, ...]:
        """The ks of a bucket's coarse round, in turn order: the model's, its rival, the split's
        neighbours above (see the class docstring); the model's alone when it decides."""
        most = most_misses(num_experts, resident, cap)
        model = plan_gpu_experts(tokens, top_k, num_experts, costs, 0, most, resident)
        if 0 < model < most:
            rival = most
        elif most >= 2:
            rival = plan_gpu_experts(tokens, top_k, num_experts, costs, 1, most - 1, resident)
        else:
            rival = most if model == 0 else 0
        if tokens * top_k < num_experts or rival == model:
            return (model,)  # most experts idle: copying ahead moves weights nobody uses
        worst = EXPLORE_WITHIN * pass_seconds(model, tokens, top_k, num_experts, costs, resident)
        near = pass_seconds(rival, tokens, top_k, num_experts, costs, resident) <= worst
        if not near and not 0 < model < most:
            return (model,)  # no split the model finds near: nothing to weigh
        split, step = (model if 0 < model < most else rival), coarse_step(most)
        above = [k for k in range(split + step, min(most, split + NEIGHBOURS * step + 1), step)
                 if pass_seconds(k, tokens, top_k, num_experts, costs, resident) <= worst]
        return (model, rival, *above) if near else (model, *above)

    def record(self, tokens: int, k: int, seconds: float) -> None:
        """A pass of `tokens` tokens streaming k misses per layer took `seconds`."""
        passes = self.measured.setdefault(self.bucket(tokens), {}).setdefault(k, [])
        passes.append(seconds / max(1, tokens))
        del passes[:-8]  # the latest few
