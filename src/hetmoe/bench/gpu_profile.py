"""Device time per kernel name of a repeated callable, by torch.profiler: the GPU profiles of
`bench_gpu_experts.py --profile`, `profile_decode.py` and `profile_step.py --gpu-activity`.

`kernel_profile` runs a callable N times under the profiler and sums each name's calls and
microseconds per run; `decode_kernels` does it for graph decode steps of one slot. Only the
profiled activity's own events count (CUDA: kernels and copies, not the CPU calls that
launched them), so nothing is counted twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hetmoe.bench import measure
from hetmoe.engine.executor.runner import ModelRunner

COPIES = ("Memcpy", "Memset")
"""Name prefixes of device activity that is not a kernel (copies and fills)."""


@dataclass(frozen=True)
class KernelRow:
    """One name's activity per run."""

    name: str
    calls: float
    """Events per run."""
    us: float
    """Microseconds per run (device time; CPU time for the CPU activity)."""


@dataclass(frozen=True)
class KernelProfile:
    """Activity per run by name, the most time first."""

    rows: tuple[KernelRow, ...]

    @property
    def busy_us(self) -> float:
        """Microseconds per run of every row (the device's busy time)."""
        return sum(r.us for r in self.rows)

    @property
    def calls(self) -> float:
        """Events per run of every row, copies included."""
        return sum(r.calls for r in self.rows)

    @property
    def kernels(self) -> float:
        """Events per run that are kernels (copies and fills left out)."""
        return sum(r.calls for r in self.rows if not r.name.startswith(COPIES))

    def minus(self, base: KernelProfile, runs: int = 1) -> KernelProfile:
        """(self - base) / runs per name, names with no calls left dropped: what a longer run
        did beyond a shorter one (their shared start cancels out), per extra step."""
        before = {r.name: r for r in base.rows}
        rows = []
        for r in self.rows:
            b = before.get(r.name, KernelRow(r.name, 0.0, 0.0))
            rows.append(KernelRow(r.name, (r.calls - b.calls) / runs, (r.us - b.us) / runs))
        return KernelProfile(_by_time(r for r in rows if r.calls > 0))


def summed(events: Iterable[Any], device: torch.autograd.DeviceType, runs: int,
           name_width: int | None = None) -> KernelProfile:
    """The profiler `events` of `device` summed per name (cut to `name_width` characters, so
    names alike up to there are one row), per run of `runs`."""
    calls: dict[str, float] = defaultdict(float)
    us: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type != device:
            continue
        name = event.name[:name_width]
        calls[name] += 1
        us[name] += (event.cpu_time_total if device == torch.autograd.DeviceType.CPU
                     else event.device_time_total)
    return KernelProfile(_by_time(KernelRow(n, calls[n] / runs, us[n] / runs) for n in calls))


def kernel_profile(run: Callable[[], object], runs: int,
                   activity: ProfilerActivity = ProfilerActivity.CUDA,
                   name_width: int | None = None) -> KernelProfile:
    """Runs `run` `runs` times under torch.profiler recording `activity` (CUDA: the GPU's
    kernels and copies, synchronized before and after); its events summed per name and run."""
    cuda = activity == ProfilerActivity.CUDA
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(runs):
            run()
        if cuda:
            torch.cuda.synchronize()  # every launched kernel inside the profile
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return summed(prof.events(), device, runs, name_width)


def decode_kernels(runner: ModelRunner, prompt: list[int], steps: int, warmup: int,
                   activity: ProfilerActivity = ProfilerActivity.CUDA,
                   name_width: int | None = None) -> KernelProfile:
    """Activity per decode step of one slot after `prompt`: `warmup` steps (graph capture),
    then `steps` profiled steps, each token read on the host; the slot freed after."""
    slot = runner.cache.allocate()
    try:
        token = measure.first_token(runner, slot, prompt)
        for _ in range(warmup):
            token = measure.next_token(runner, slot, token)

        def step() -> None:
            nonlocal token
            token = measure.next_token(runner, slot, token)

        return kernel_profile(step, steps, activity, name_width)
    finally:
        runner.cache.free(slot)


def _by_time(rows: Iterable[KernelRow]) -> tuple[KernelRow, ...]:
    return tuple(sorted(rows, key=lambda r: -r.us))
