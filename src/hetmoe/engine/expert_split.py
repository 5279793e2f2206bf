"""Where a prefill pass runs each MoE layer's routed experts: the CPU, the GPU, or both at once.

A pass of T tokens gives each layer P = T * top_k (token, slot) pairs. The GPU computes the first
k experts of every layer (ids 0..k-1), their packed bytes copied over PCIe ahead of use (layer
i + 2's copy during layer i's compute: the copy does not wait for the router, so both sides work
from the start of a layer); the CPU computes the other E - k experts of the same layer at the
same time. k = E streams every expert (the CPU idles), k = 0 is the CPU alone (no copy).

Per layer, with an even spread of the pairs (n = P / E per expert; an expert of the CPU's share
costs its fixed part only if some pair chose it: probability a = 1 - (1 - 1/E)^P):

    copy(k) = k * gpu_expert                               (the copy engine, ahead of use)
    GPU(k)  = k * (gpu_fixed + n * gpu_token)              (unpack, grouped GEMM)
    CPU(k)  = cpu_call + (E - k) * (a * cpu_fixed + n * cpu_token)

    k = E:       max(copy(E), GPU(E))
    k = 0:       CPU(0)
    otherwise:   max(copy(k), split_fixed + T * split_token + max(CPU(k), GPU(k)))

(a split layer's round trip, its activations to the host and the CPU's sum back, is serial with
both sides). `plan_gpu_experts` takes the k of the smallest time. The costs come from this
machine's measured rates (`costs_from_profile`, hetmoe.calibration), so where the GPU starts to
pay off is measured, not a constant.
"""

from __future__ import annotations

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
    """A split layer: the host's wait for the router before the CPU's share can start."""
    split_token: float = 0.0
    """A split layer: each token's activations to the host and the CPU's sum back."""


def layer_seconds(k: int, tokens: int, top_k: int, num_experts: int, costs: SplitCosts) -> float:
    """Expected seconds of one layer whose first `k` experts run on the GPU, the rest on the
    CPU, for `tokens` tokens spread evenly (the later side)."""
    if not 0 <= k <= num_experts:
        raise ValueError(f"k must be in [0, {num_experts}], got {k}")
    pairs = tokens * top_k
    n = pairs / num_experts
    active = 1.0 - (1.0 - 1.0 / num_experts) ** pairs
    copy = k * costs.gpu_expert
    gpu = k * (costs.gpu_fixed + n * costs.gpu_token)
    cpu = costs.cpu_call + (num_experts - k) * (active * costs.cpu_fixed + n * costs.cpu_token)
    if k == num_experts:
        return max(copy, gpu)
    if k == 0:
        return cpu
    return max(copy, costs.split_fixed + tokens * costs.split_token + max(cpu, gpu))


def plan_gpu_experts(tokens: int, top_k: int, num_experts: int, costs: SplitCosts,
                     least: int = 0, most: int | None = None) -> int:
    """The k in [least, most] (default [0, E]) of the fewest expected seconds per layer: how
    many experts of each layer (its first k) a pass of `tokens` tokens runs on the GPU. Ties
    go to the smaller k (fewer bytes over PCIe)."""
    most = num_experts if most is None else most
    if not 0 <= least <= most <= num_experts:
        raise ValueError(f"need 0 <= least <= most <= {num_experts}, got {least}, {most}")
    return min(range(least, most + 1),
               key=lambda k: (layer_seconds(k, tokens, top_k, num_experts, costs), k))


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
        # The host waits for the router as a pool call waits for its workers (a proxy: one
        # wake-up each way); activations cross to the host by copy (bf16), the CPU's sum is
        # read in place by the GPU's add.
        split_fixed=profile.cpu_call_s,
        split_token=2 * hidden * (1 / (profile.d2h_bytes_s or profile.h2d_bytes_s)
                                  + 1 / (profile.gpu_host_read_bytes_s or profile.h2d_bytes_s)),
    )


def describe_plan(k: int, num_experts: int) -> str:
    """A plan's k in words."""
    if k == 0:
        return "CPU"
    if k == num_experts:
        return "GPU stream"
    return f"split ({k} of {num_experts} experts on the GPU)"


EXPLORE_WITHIN = 1.5
"""`PrefillTuner` times an alternative to the model's choice only when the model predicts it
within this factor of the choice (its largest measured error so far is 1.3x: round 3 in
docs/benchmarks/prefill.md's git history), so a 1-token prompt never tries streaming every
expert."""


TRIES = 2
"""Passes each of the two strategies gets in a length bucket before the faster is kept: the
first pass of a strategy may carry one-time costs (pinned buffers, kernel selection)."""


class PrefillTuner:
    """Measured prefill seconds per token of each strategy (CPU, split, stream) per prompt-length
    bucket (a power of two): in a new bucket the model's k and its most likely rival of another
    strategy (the stream if the model split, its best split if it streamed or stayed on the CPU)
    take turns, `TRIES` passes each, then the k of the strategy with the best pass is kept. The
    cost model ranks; what this machine measured decides. Passes with fewer (token, expert)
    pairs than experts (a chat turn's few new tokens) keep the model's pick: no rival there
    could pay for experts copied ahead that no token uses."""

    def __init__(self) -> None:
        self.measured: dict[int, dict[str, list[float]]] = {}
        """bucket -> {strategy: seconds per token of each of its passes}"""

    @staticmethod
    def bucket(tokens: int) -> int:
        return max(1, tokens).bit_length()

    @staticmethod
    def strategy(k: int, num_experts: int) -> str:
        return "cpu" if k == 0 else "stream" if k == num_experts else "split"

    def choose(self, tokens: int, top_k: int, num_experts: int, costs: SplitCosts) -> int:
        """The k for a pass of `tokens` tokens (see the class docstring)."""
        model = plan_gpu_experts(tokens, top_k, num_experts, costs)
        if 0 < model < num_experts:
            rival = num_experts
        else:
            rival = plan_gpu_experts(tokens, top_k, num_experts, costs, 1, num_experts - 1)
        if tokens * top_k < num_experts:
            return model  # most experts idle: copying experts ahead moves weights nobody uses
        predicted = layer_seconds(model, tokens, top_k, num_experts, costs)
        if layer_seconds(rival, tokens, top_k, num_experts, costs) > EXPLORE_WITHIN * predicted:
            return model
        times = self.measured.get(self.bucket(tokens), {})
        mine, theirs = (times.get(self.strategy(k, num_experts), []) for k in (model, rival))
        if min(len(mine), len(theirs)) < TRIES:
            return rival if len(theirs) < len(mine) else model
        return model if min(mine) <= min(theirs) else rival

    def record(self, tokens: int, k: int, num_experts: int, seconds: float) -> None:
        """A pass of `tokens` tokens with k of `num_experts` experts on the GPU took
        `seconds`."""
        strategy = self.strategy(k, num_experts)
        passes = self.measured.setdefault(self.bucket(tokens), {}).setdefault(strategy, [])
        passes.append(seconds / max(1, tokens))
        del passes[:-8]  # the latest few
