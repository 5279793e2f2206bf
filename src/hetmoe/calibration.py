"""This machine's measured rates (`MachineProfile`): what sets where GPU prefill and the CPU+GPU
split of a layer's experts begin, instead of constants tuned on one box.

`measure` times the CPU pool's DRAM reads, one small CpuMoE call, the routed-expert kernels per
packed format at prefill sizes (AMX where the CPU has it) and, with a CUDA device, pinned copies
both ways and the GPU prefill's routed-expert compute (the packed kernels, or unpack + grouped
GEMM where they cannot run). `current` returns the profile stored for
this machine (`profile_path`), measuring and saving it on first use; `hetmoe calibrate` measures
on demand and `hetmoe info` prints it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from hetmoe import calibration_timing as timing
from hetmoe import env
from hetmoe.machine import cpu_model

# `hetmoe._cpu` is imported inside the functions that call it: the C++ extension may be absent
# (experts/cpu_backend.py `unavailable` says so by name), and this module loads without it.

log = logging.getLogger(__name__)

PROFILE_VERSION = 6
"""Bumped when a field's meaning or a measurement changes: older files are measured again (4:
int4 experts on AMX run bf16 tiles, ~1.5x the old rate at prefill sizes; 5: GPU prefill
computes on the packed bytes with the Triton kernels, no unpack; 6: AMX int4 widens the next
n-block pair's weights while the tile unit multiplies this one, so its per-expert cost, the
int4 line's intercept, changed)."""

FORMATS = ("bf16", "int8", "int4", "fp8")
"""CPU expert formats `measure` can time."""

DEFAULT_FORMATS = ("bf16", "int8", "int4")
"""Formats measured unless asked otherwise (fp8 only serves FP8 checkpoints)."""


@dataclass(frozen=True)
class MachineProfile:
    """Rates measured on one machine (see the module docstring); FLOPs of one (token, expert)
    pair are 6 * H * I (gate, up and down products)."""

    machine: str
    """`fingerprint`: CPU model, logical cores, GPU name (or "no GPU"), torch version; a stored
    profile of another fingerprint is not used."""
    measured_at: str
    """ISO date-time (UTC) of the measurement."""
    cpu_threads: int
    """Pool workers that ran the CPU measurements (hetmoe._cpu's pool)."""
    cpu_read_bytes_s: float
    """Bytes/s the pool's workers read from DRAM."""
    cpu_call_s: float
    """Fixed seconds of one CpuMoE submit + sync beyond its weight reads (job start, barriers):
    a tiny layer, one token, best of many."""
    cpu_flops: dict[str, float]
    """Per CPU expert format: FLOP/s of the routed-expert kernels at prefill sizes, from the
    slope between two token counts per expert (the weight reads cancel)."""
    cpu_expert_bytes_s: dict[str, float]
    """Per format: an expert's packed bytes over the seconds an expert costs beyond its
    tokens' products (the line's intercept: its weights read, its blocks set up), with the
    weights coming from DRAM (each repeat on other experts)."""
    h2d_bytes_s: float | None
    """Pinned host -> GPU copy bytes/s (None: measured without CUDA)."""
    d2h_bytes_s: float | None
    """Pinned GPU -> host copy bytes/s (None: measured without CUDA)."""
    gpu_host_read_bytes_s: float | None
    """Bytes/s a GPU kernel reads pinned host memory in place (`experts.gpu_view`: how a
    split layer's CPU sum reaches the GPU; None: measured without CUDA)."""
    gpu_flops: dict[str, float] | None
    """Per format: GPU FLOP/s of the routed experts over resident packed experts as GPU prefill
    computes them (`LayerStreamer.packed_kernel`: the packed kernels, else unpack + grouped
    GEMM), from the slope between two token counts (None: measured without CUDA)."""
    gpu_expert_bytes_s: dict[str, float] | None
    """Per format: an expert's packed bytes over its fixed GPU seconds (the line's intercept:
    its bytes read and dequantized, or unpacked; None: measured without CUDA)."""
    cpu_int4_kernel: str | None
    """`int4_kernel()` that timed the int4 rates (None: int4 not timed). Int4 rates of another
    kernel, or of a file from before this field (read as None), do not cover int4."""


def fingerprint(device: torch.device | None = None) -> str:
    """This machine as a profile is valid for: CPU model, logical cores, the GPU (`device`'s,
    else the first visible one) and the torch version."""
    if device is not None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = "no GPU"
    return f"{cpu_model()}; {os.cpu_count()} logical cores; {gpu}; torch {torch.__version__}"


def int4_kernel() -> str:
    """The int4 kernel CpuMoE runs here at prefill sizes, under HETMOE_ISA's cap resolved as its
    layers resolve it (`_cpu.resolve_isa`: a cap this CPU lacks refused): "amx-i8" or "amx-bf16" on
    AMX (the AMX int4 kernel, `_cpu.amx_int4_kernel()`:
    HETMOE_AMX_INT4, a bad value refused there naming it), else the ISA's one int4 kernel
    ("avx512", "avx2", "scalar")."""
    from hetmoe import _cpu

    isa = _cpu.resolve_isa(env.forced_isa() or "auto")
    return f"amx-{_cpu.amx_int4_kernel()}" if isa == "amx" else isa


def int4_mismatch(profile: MachineProfile, kernel: str) -> str | None:
    """Why `profile`'s int4 rates are not this process's (timed on another int4 kernel than
    `kernel`, or in a file from before the kernel was recorded), or None when they are."""
    if profile.cpu_int4_kernel == kernel:
        return None
    if profile.cpu_int4_kernel is None:
        return ("the stored int4 rates do not say which int4 kernel timed them (a file from "
                f"before that field), this process runs {kernel}")
    return (f"the stored int4 rates are of the {profile.cpu_int4_kernel} int4 kernel, this "
            f"process runs {kernel}")


def profile_path() -> Path:
    """Where the profile is stored: machine_profile.json in hetmoe's cache dir (env.cache_dir:
    HETMOE_CACHE_DIR, else ~/.cache/hetmoe)."""
    return env.cache_dir() / "machine_profile.json"


def check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """`formats` as a tuple; ValueError naming any format `measure` cannot time."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"formats must be among {', '.join(FORMATS)} (at least one), got "
                         f"{', '.join(map(repr, formats)) or 'none'}")
    return tuple(dict.fromkeys(formats))


def save(profile: MachineProfile, path: Path | None = None) -> Path:
    """Writes `profile` as JSON (to a temporary name, then renamed) and returns the path."""
    path = path or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": PROFILE_VERSION, **asdict(profile)}, indent=1))
    tmp.replace(path)
    return path


def load(path: Path | None = None, *, device: torch.device | None = None
         ) -> MachineProfile | None:
    """The stored profile; None when there is none, it is of an older version or of another
    machine (`fingerprint(device)`). ValueError naming the file when it cannot be read."""
    path = path or profile_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable machine profile ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a machine profile is a JSON object, found "
                         f"{type(raw).__name__}")
    if raw.get("version") != PROFILE_VERSION:
        return None
    profile = _from_json(raw, path)
    return profile if profile.machine == fingerprint(device) else None


def _from_json(raw: dict[str, Any], path: Path) -> MachineProfile:
    def rates(name: str, value: object) -> dict[str, float]:
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and _rate(v) for k, v in value.items()):
            raise ValueError(f"{path}: field {name} must map formats to positive numbers, "
                             f"found {value!r}")
        return {k: float(v) for k, v in value.items()}

    # cpu_int4_kernel may be absent: a file from before it (int4 then not covered, `current`).
    names = [f.name for f in fields(MachineProfile) if f.name != "cpu_int4_kernel"]
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"{path}: machine profile lacks field(s) {', '.join(missing)}")
    for name in ("machine", "measured_at"):
        if not isinstance(raw[name], str):
            raise ValueError(f"{path}: field {name} must be a string, found {raw[name]!r}")
    if not isinstance(raw["cpu_threads"], int) or raw["cpu_threads"] < 1:
        raise ValueError(f"{path}: field cpu_threads must be a positive integer, found "
                         f"{raw['cpu_threads']!r}")
    optional = ("h2d_bytes_s", "d2h_bytes_s", "gpu_host_read_bytes_s")
    for name in ("cpu_read_bytes_s", "cpu_call_s", *optional):
        value = raw[name]
        if not (_rate(value) or (value is None and name in optional)):
            raise ValueError(f"{path}: field {name} must be a positive number, found {value!r}")
    int4 = raw.get("cpu_int4_kernel")
    if not (int4 is None or isinstance(int4, str)):
        raise ValueError(f"{path}: field cpu_int4_kernel must be a string or null, found "
                         f"{int4!r}")
    gpu, gpu_bytes = raw["gpu_flops"], raw["gpu_expert_bytes_s"]
    return MachineProfile(
        machine=raw["machine"], measured_at=raw["measured_at"], cpu_threads=raw["cpu_threads"],
        cpu_read_bytes_s=float(raw["cpu_read_bytes_s"]), cpu_call_s=float(raw["cpu_call_s"]),
        cpu_flops=rates("cpu_flops", raw["cpu_flops"]),
        cpu_expert_bytes_s=rates("cpu_expert_bytes_s", raw["cpu_expert_bytes_s"]),
        h2d_bytes_s=None if raw["h2d_bytes_s"] is None else float(raw["h2d_bytes_s"]),
        d2h_bytes_s=None if raw["d2h_bytes_s"] is None else float(raw["d2h_bytes_s"]),
        gpu_host_read_bytes_s=(None if raw["gpu_host_read_bytes_s"] is None
                               else float(raw["gpu_host_read_bytes_s"])),
        gpu_flops=None if gpu is None else rates("gpu_flops", gpu),
        gpu_expert_bytes_s=None if gpu_bytes is None else rates("gpu_expert_bytes_s",
                                                                 gpu_bytes),
        cpu_int4_kernel=int4)


def _rate(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def current(device: torch.device | None = None,
            formats: Sequence[str] = DEFAULT_FORMATS) -> MachineProfile:
    """The stored profile when it is this machine's, of this pool size, and covers `formats`
    (and the GPU parts when `device` is CUDA; int4 only as timed on this process's
    `int4_kernel()`); else measures once (the formats stored before too), saves and returns it:
    the first-run default."""
    from hetmoe import _cpu

    formats = check_formats(formats)
    cuda = device is not None and device.type == "cuda"
    try:
        stored = load(device=device)
    except ValueError as exc:
        log.warning("%s; measuring this machine again", exc)
        stored = None
    why = "no stored profile covers them"
    if stored is not None:
        covered = set(formats) <= set(stored.cpu_flops) and (
            not cuda or (stored.gpu_flops is not None and set(formats) <= set(stored.gpu_flops)))
        stale = int4_mismatch(stored, int4_kernel()) if "int4" in formats else None
        if covered and stale:
            covered, why = False, stale
        threads = _cpu.pool_info()["threads"]
        if covered and stored.cpu_threads == threads:
            return stored
        if covered:
            why = (f"the stored rates are of {stored.cpu_threads} pool threads, this pool has "
                   f"{threads}")
        formats = check_formats([*formats, *(f for f in stored.cpu_flops if f not in formats)])
    log.info("measuring this machine's rates (%s experts%s), once: %s (`hetmoe calibrate` "
             "measures again)", ", ".join(formats), ", the GPU" if cuda else "", why)
    start = time.perf_counter()
    profile = measure(formats, device if cuda else None)
    path = save(profile)
    log.info("machine profile measured in %.1f s, saved to %s", time.perf_counter() - start, path)
    return profile


def measure(formats: Sequence[str] = DEFAULT_FORMATS, device: torch.device | None = None,
            progress: Callable[[str], None] | None = None, *, hidden: int = 2048,
            intermediate: int = 768, experts: int = 16, tokens: tuple[int, int] = (32, 256),
            gpu_tokens: tuple[int, int] = (64, 1024), read_bytes: int = 2**30,
            copy_bytes: int = 2**28,
            repeats: int = 3) -> MachineProfile:
    """Measures this machine (seconds; the GPU parts only when `device` is CUDA). The expert
    rates are timed on a layer of `experts` experts of hidden x intermediate (default: the
    Qwen3-30B-A3B expert) with random weights, `tokens` tokens per expert on the CPU (the slope
    between the two counts) and `gpu_tokens` on the GPU; `progress` gets a line per step."""
    from hetmoe import _cpu

    formats = check_formats(formats)
    if not 0 < tokens[0] < tokens[1]:
        raise ValueError(f"tokens must be two increasing positive counts, got {tokens!r}")
    say = progress or (lambda line: None)
    cuda = device is not None and device.type == "cuda"
    say("CPU read bandwidth")
    read = _cpu.read_bandwidth(read_bytes, 5)
    say("CPU call overhead")
    call = timing.call_seconds()
    # (repeats + 1) windows of `experts` experts: each timing reads weights no earlier one read.
    weights = timing.random_weights(experts * (repeats + 1), hidden, intermediate)
    cpu_flops: dict[str, float] = {}
    cpu_bytes: dict[str, float] = {}
    gpu_flops: dict[str, float] = {}
    gpu_bytes: dict[str, float] = {}
    pair_flops = 6 * hidden * intermediate
    for fmt in formats:
        say(f"{fmt} experts on the CPU")
        moe = timing.loaded_moe(fmt, weights)
        expert_bytes = sum(p.expert_bytes for p in moe.packed_groups())
        fixed, pair = timing.cpu_line(moe, experts, tokens, repeats)
        cpu_flops[fmt] = pair_flops / pair
        cpu_bytes[fmt] = expert_bytes / fixed
        if cuda:
            assert device is not None
            say(f"{fmt} experts on the GPU")
            fixed, pair = timing.gpu_line(moe, experts, device, gpu_tokens, repeats)
            gpu_flops[fmt] = pair_flops / pair
            gpu_bytes[fmt] = expert_bytes / fixed
    h2d = d2h = host_read = None
    if cuda:
        assert device is not None
        say("pinned copies")
        h2d, d2h = timing.copy_rates(device, copy_bytes, repeats)
        host_read = timing.host_read_rate(device, copy_bytes // 4, repeats)
    return MachineProfile(
        machine=fingerprint(device), measured_at=datetime.now(timezone.utc).isoformat(
            timespec="seconds"), cpu_threads=int(_cpu.pool_info()["threads"]),
        cpu_read_bytes_s=read, cpu_call_s=call, cpu_flops=cpu_flops,
        cpu_expert_bytes_s=cpu_bytes, h2d_bytes_s=h2d, d2h_bytes_s=d2h,
        gpu_host_read_bytes_s=host_read,
        gpu_flops=gpu_flops if cuda else None, gpu_expert_bytes_s=gpu_bytes if cuda else None,
        cpu_int4_kernel=int4_kernel() if "int4" in formats else None)


def summary(profile: MachineProfile) -> dict[str, str]:
    """The profile's rates as printable strings (`hetmoe calibrate`, `hetmoe info`)."""
    lines = {
        "measured_at": f"{profile.measured_at} ({profile.cpu_threads} pool threads)",
        "cpu_read": f"{profile.cpu_read_bytes_s / 1e9:.1f} GB/s",
        "cpu_call": f"{profile.cpu_call_s * 1e6:.1f} µs",
    }
    for fmt, rate in profile.cpu_flops.items():
        kernel = f" ({profile.cpu_int4_kernel or 'kernel not recorded'})" if fmt == "int4" else ""
        lines[f"cpu_{fmt}"] = f"{rate / 1e12:.2f} TFLOPS{kernel}"
        lines[f"cpu_{fmt}_expert"] = f"{profile.cpu_expert_bytes_s[fmt] / 1e9:.1f} GB/s"
    if profile.h2d_bytes_s is not None and profile.d2h_bytes_s is not None:
        lines["h2d_pinned"] = f"{profile.h2d_bytes_s / 1e9:.1f} GB/s"
        lines["d2h_pinned"] = f"{profile.d2h_bytes_s / 1e9:.1f} GB/s"
    if profile.gpu_host_read_bytes_s is not None:
        lines["gpu_reads_host"] = f"{profile.gpu_host_read_bytes_s / 1e9:.1f} GB/s"
    for fmt, rate in (profile.gpu_flops or {}).items():
        lines[f"gpu_{fmt}"] = f"{rate / 1e12:.1f} TFLOPS"
        unpack = (profile.gpu_expert_bytes_s or {}).get(fmt, 0.0)
        lines[f"gpu_{fmt}_unpack"] = f"{unpack / 1e9:.0f} GB/s"
    return lines

