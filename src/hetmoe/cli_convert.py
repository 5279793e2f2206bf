"""`hetmoe convert` and `hetmoe info MODEL`: converted directories and memory plans (cli.py
registers these commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hetmoe.cli_exit import fail
from hetmoe.config import DEFAULT_MAX_BATCH
from hetmoe.machine import machine_report

# Commands import what they run inside their functions: `hetmoe --help` imports none of torch,
# transformers, rich, httpx, the engine or the loaders (tests/test_cli_basics.py).

ExpertFormatOpt = Annotated[str | None, typer.Option(
    "--experts", help="Packed expert format: bf16, int8, int4 or fp8 (default: bf16; fp8 for an "
                      "FP8 checkpoint; for a GGUF the nearest to its quant type)")]
GroupOpt = Annotated[int | None, typer.Option(
    "--group", help="int8/int4 quantization group: 32, 64, 128 or 256 (default: the format's)")]


def convert(
    source: Annotated[str, typer.Argument(help="Checkpoint directory, GGUF file or preset")],
    out: Annotated[Path, typer.Argument(help="Converted directory to write (resumable)")],
    experts: ExpertFormatOpt = None,
    group: GroupOpt = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the files and memory plan; write nothing")] = False,
) -> None:
    """Convert SOURCE into OUT for instant start.

    OUT holds the packed experts in the CPU backend's layout (one file per MoE layer), the other
    weights, config, tokenizer and a manifest; `hetmoe generate OUT ...` maps it. A rerun
    finishes an interrupted conversion.
    """
    from hetmoe.loading.convert import ConvertOptions
    from hetmoe.loading.convert_source import (
        checkpoint_format,
        convert_source,
        default_format,
        is_gguf,
    )
    from hetmoe.presets import resolve_model

    try:
        path = resolve_model(source)
        fmt, why = experts or "bf16", "as asked" if experts else "the default"
        if is_gguf(path) and experts is None:
            fmt, group, why = default_format(path)
        elif experts is None:
            fmt, group, why = checkpoint_format(path, group)
        typer.echo(f"experts: {fmt}{f', group {group}' if group else ''} ({why})", err=True)
        if dry_run:
            print_plan(path, fmt, group, None, files=True)
            return
        convert_source(path, out, ConvertOptions(fmt, group))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)
    typer.echo(f"converted {source} into {out}")


def info(
    model: Annotated[str | None, typer.Argument(
        help="Checkpoint, converted directory or preset: print its memory plan")] = None,
    experts: ExpertFormatOpt = None,
    group: GroupOpt = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Converted directory: check every file's full checksum")] = False,
) -> None:
    """Print CPU, ISA, NUMA, GPU, versions, measured rates; with MODEL, its memory plan.

    The ISA line says whether AMX is there and allowed by the OS (hetmoe's fast prefill); the
    rates are the machine profile that `hetmoe calibrate` stores. With MODEL: host and GPU
    bytes per component in the chosen expert format, and whether they fit.
    """
    if model is None:
        for key, value in {**machine_report(), **profile_report()}.items():
            typer.echo(f"{key:<16} {value}")
        return
    from hetmoe.engine.model.model_setup import check_device
    from hetmoe.loading.convert_source import is_gguf
    from hetmoe.loading.converted import is_converted, open_converted
    from hetmoe.presets import resolve_model

    try:
        path = resolve_model(model)
        if is_gguf(path):
            raise ValueError(f"{path}: a GGUF file; `hetmoe convert --dry-run {model} OUT` "
                             "prints its format choice, `hetmoe info OUT` the plan")
        if is_converted(path):
            converted = open_converted(path, verify)
            experts, group = converted.weight_format, converted.group_size
            typer.echo(f"{path}: converted, files checked{' (full checksums)' if verify else ''}")
        print_plan(path, experts or "bf16", group, check_device(device), files=False)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        fail(exc)


def profile_report() -> dict[str, str]:
    """The stored machine profile's lines for `hetmoe info` (or why there is none)."""
    from hetmoe import calibration

    try:
        profile = calibration.load()
    except ValueError as exc:
        return {"profile": f"unreadable ({exc}); `hetmoe calibrate` measures a new one"}
    if profile is None:
        return {"profile": "none stored for this machine; `hetmoe calibrate` makes one"}
    return {"profile": str(calibration.profile_path()), **calibration.summary(profile)}


def print_plan(path: Path, fmt: str, group: int | None, device: object,
               files: bool) -> None:
    """The memory plan of `path` with `fmt` experts (and with `files`, what convert writes)."""
    import torch

    from hetmoe.engine.model.model_setup import default_device
    from hetmoe.engine.model.model_source import default_window
    from hetmoe.engine.placement.placement_plan import planned_placement
    from hetmoe.loading.checkpoint import Checkpoint
    from hetmoe.loading.convert_plan import plan_convert
    from hetmoe.loading.memory_plan import memory_plan

    plan = plan_convert(Checkpoint.open(path), fmt, group)
    if files:
        for name, size in plan.file_sizes().items():
            typer.echo(f"{name:<36} {size / 1e9:10.3f} GB  ({size} bytes)")
        total = sum(plan.file_sizes().values())
        typer.echo(f"{'total on disk':<36} {total / 1e9:10.3f} GB  ({total} bytes)")
    config = plan.checkpoint.config
    window = default_window(config)
    chosen = device if isinstance(device, torch.device) else default_device()
    typer.echo(f"memory on {chosen} ({DEFAULT_MAX_BATCH} slots x {window} tokens of KV):")
    mem = memory_plan(plan.skeleton, chosen, plan.dtype, config, DEFAULT_MAX_BATCH * window,
                      fmt, plan.group_size)
    typer.echo(mem.table())
    placement = planned_placement(mem)  # what `--gpu-expert-gib auto` keeps on the GPU
    typer.echo("GPU experts: none (no GPU, or no routed experts in the cpu backend)"
               if placement is None else f"{placement.describe()} [--gpu-expert-gib auto]")
    if plan.layers:
        typer.echo(prefill_plan(plan.layers[0], fmt, config, placement))
        typer.echo(deferral_plan(path, chosen))
        typer.echo(DEFER_ORDER_LINE)


def deferral_plan(path: Path, device: Any) -> str:
    """What `--deferred auto` picks for `path` on `device`: 0 without a GPU, else the choice
    last made when the model loaded here (engine/model/deferral_auto.py), or that none was."""
    from hetmoe.engine.model.deferral_auto import NO_GPU, recorded_deferral

    if device.type != "cuda":
        return f"deferred auto: 0 ({NO_GPU})"
    try:
        line = recorded_deferral(path, device)
    except ValueError as exc:
        return f"deferred auto: {exc}"
    return line or ("deferred auto: chosen when the model loads with --deferred auto (decode "
                    "step times measured, then a probe's KL); not yet run for this model on "
                    "this machine")


DEFER_ORDER_LINE = ("deferral order: misses by default (each token's lowest-scored CPU misses "
                    "only, experts resident on the GPU at once); --defer-order score defers its "
                    "lowest-scored experts (the paper's order)")


PREFILL_LENGTHS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def prefill_plan(layer: Any, fmt: str, config: Any, placement: Any = None) -> str:
    """Where the prefill planner puts a prefill's routed experts per prompt length on this
    machine (the stored profile; `placement`'s resident experts counted; `auto` then measures
    its pick against the rival), or why it cannot say; with every expert resident, that (no
    profile read, as the runner loads no costs then)."""
    import torch

    from hetmoe import calibration
    from hetmoe.engine.executor.prefill_planner import PrefillPlanner
    from hetmoe.engine.placement.expert_split import layer_costs

    if placement is not None and placement.everything:  # no costs to weigh: none loaded
        return ("prefill plan: every routed expert resident on the GPU (above), so prefill "
                "computes them all there: no CPU expert work, nothing to stream")
    try:
        profile = calibration.load()
    except ValueError as exc:
        return f"prefill plan: the machine profile is unreadable ({exc})"
    if (profile is None or profile.h2d_bytes_s is None) and not torch.cuda.is_available():
        return "prefill plan: no GPU here, so prefill runs the routed experts on the CPU"
    if profile is None or profile.h2d_bytes_s is None:
        return ("prefill plan: needs this machine's profile with its GPU "
                "(`hetmoe calibrate --device cuda`)")
    if fmt == "int4" and (stale := calibration.int4_mismatch(profile, calibration.int4_kernel())):
        return f"prefill plan: {stale} (`hetmoe calibrate` measures them again)"
    experts, hidden, intermediate = layer.shape
    expert_bytes = sum(g["expert_bytes"] for g in layer.groups)
    try:
        costs = layer_costs(profile, fmt, hidden, intermediate, expert_bytes)
    except ValueError as exc:
        return f"prefill plan: {exc}"
    layers = len(placement.resident) if placement is not None else 1
    staging = placement.staging if placement is not None else None
    planner = PrefillPlanner(experts, int(config.num_experts_per_tok), layers, costs,
                             refusal=lambda: staging.why if staging else "",
                             cap=(lambda: staging.experts) if staging else None)
    planner.place(placement)
    counted = " and the GPU experts above" if placement is not None else ""
    lines = [f"prefill plan (cost model, this machine's profile{counted}; auto measures its "
             "pick against the rival):"]
    for tokens in PREFILL_LENGTHS:
        lines.append(f"  {tokens:>6} tokens  {planner.describe(planner.gpu_experts(tokens))}")
    return "\n".join(lines)
