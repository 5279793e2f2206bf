"""`hetmoe bench`: one model build, its speed in every requested mode, as a JSON-ready dict.

Modes by `BenchConfig.experts`:
- `cpu` (ours): `ModelRunner` (overlap, CUDA-graph decode of the fused layer functions, CPU
  experts started/awaited through ready/done flags); decode for each `deferred` value and the
  attention window buckets those steps used (`decode_windows`, with graph capture times); with
  `eager`, also eager decode and launches per token, and with `alternatives` graph decode of the
  HF layers (`module_path`, before the fused decode; real and without CPU work); a trace of a few
  eager steps, prefill speed per length.
- `torch-cpu` (baseline): the same injected model with plain-torch experts on the CPU, the plain
  `ModelRunner` (no graphs, no overlap).
- `accelerate` (baseline): unmodified transformers, experts offloaded by accelerate
  (bench/baselines.py).
The bound is host read bandwidth / routed-expert bytes per token (measured before the build);
each timed graph decode also gets the pool's reads just before and after it (`read_gb_s_around`,
`of_adjacent_bound`), since the host's bandwidth drifts within a run.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.baselines import build_offloaded_hf_model, hf_generate_speed
from hetmoe.bench.bench_config import BenchConfig
from hetmoe.bench.decode_modes import (
    decode_each_deferred,
    decode_entry,
    graph_variants,
    trace_steps,
)
from hetmoe.bench.memory import check_memory
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.engine import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.machine import huge_page_bytes, source_commit


def _pool_bound(cfg: BenchConfig, result: dict[str, Any]) -> None:
    """The CPU backend's own workers reading: a second, same-run bandwidth for the bound, which
    becomes the faster of the two plain reads (the strictest denominator)."""
    from hetmoe import _cpu  # the C++ extension: the cpu mode only

    size = int(cfg.bandwidth_gib * 2**30)
    result["pool_read_gb_s"] = round(_cpu.read_bandwidth(size, 5) / 1e9, 1)
    result["pool_bound_tok_s"] = round(
        result["pool_read_gb_s"] * 1e9 / result["routed_bytes_per_token"], 2)
    result["bound_tok_s"] = max(result["bound_tok_s"], result["pool_bound_tok_s"])


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    """Builds the model of `cfg`, measures it, returns the result dict (see the module doc)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    window = max((*cfg.prefill_lengths, 0)) + cfg.prompt_len + cfg.new_tokens + 8
    if cfg.shape is not None and cfg.experts != "accelerate":  # refused before any allocation
        plan = check_memory(cfg.shape, cfg.num_layers, device, cfg.weight_format, window,
                            int(cfg.bandwidth_gib * 2**30))
        log(f"memory plan: {plan.total('host') / 1e9:.1f} GB of host memory "
            f"({plan.host_free / 1e9:.1f} GB available)")
    result: dict[str, Any] = {"config": asdict(cfg), "date": now_utc(), "git": git_sha(),
                              "machine": machine_facts(device)}
    result["read_gb_s"] = round(measure.read_bandwidth(cfg.bandwidth_gib), 1)
    log(f"host read bandwidth {result['read_gb_s']} GB/s")
    config: Any  # the transformers config of the model or of the shape
    if cfg.model is not None:
        # The bench's own runner places the experts (below): none by the LLM's.
        llm = LLM(cfg.model, device=device, progress=False, gpu_expert_bytes=0)
        model, config = llm.model, llm.model.config
    else:
        assert cfg.shape is not None  # __post_init__: exactly one of shape and model is set
        config = shape_config(cfg.shape, cfg.num_layers)
    prompt = torch.randint(0, config.vocab_size, (cfg.prompt_len,),
                           generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    if cfg.experts == "accelerate":  # transformers + accelerate offload
        start = time.perf_counter()
        hf_model = build_offloaded_hf_model(config, seed=cfg.seed)
        result["build_s"] = round(time.perf_counter() - start, 1)
        result["decode"] = {"accelerate": hf_generate_speed(hf_model, prompt, cfg.new_tokens)}
        return result
    start = time.perf_counter()
    if cfg.model is None:
        model = build_random_model(config, device, torch.bfloat16, cfg.experts,
                                   cfg.weight_format, cfg.seed)
    result["build_s"] = round(time.perf_counter() - start, 1)
    result["huge_page_gb"] = round(huge_page_bytes() / 1e9, 1)  # of the whole process
    log(f"built {cfg.shape or cfg.model} ({cfg.experts}, {cfg.weight_format}) in "
        f"{result['build_s']} s")
    result["routed_bytes_per_token"] = measure.routed_bytes_per_token(model)
    result["bound_tok_s"] = round(result["read_gb_s"] * 1e9 / result["routed_bytes_per_token"], 2)
    if cfg.experts == "cpu":
        _pool_bound(cfg, result)
    if cfg.experts == "torch-cpu":
        runner = ModelRunner(model, device, torch.bfloat16, 1, window)
        run = measure.greedy_decode(runner, prompt, cfg.new_tokens)
        result["decode"] = {"torch-cpu": decode_entry(run, result["bound_tok_s"])}
        result["prefill_tok_s"] = {str(n): round(measure.prefill_speed(runner, n,
                                   config.vocab_size, 1), 1) for n in cfg.prefill_lengths}
        return result
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, device, dtype, 1, window,
                         EngineConfig(deferred=cfg.deferred[0], defer_order=cfg.defer_order,
                                      gpu_expert_bytes=cfg.gpu_expert_bytes))
    result["defer_order"] = cfg.defer_order
    if runner.placement is not None:
        result["gpu_experts"] = runner.placement.plan.describe()
        log(result["gpu_experts"])
    cpu_ms = measure.cpu_experts_ms(model)
    result["cpu_experts_ms_per_token"] = round(cpu_ms, 3)
    result["cpu_experts_of_bound"] = round(1e3 / cpu_ms / result["bound_tok_s"], 3)
    log(f"routed experts alone on the CPU: {cpu_ms:.2f} ms/token")
    tokens = decode_each_deferred(runner, cfg, prompt, result, log)
    graph_variants(runner, model, cfg, prompt, window, result, tokens, log)
    if cfg.trace:
        result["trace"] = trace_steps(runner, prompt, cfg.trace)
    result.update(_prefill(runner, cfg, config.vocab_size, log))
    del runner, model
    gc.collect()
    return result


def _prefill(runner: ModelRunner, cfg: BenchConfig, vocab: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Prefill tok/s per length as the engine chooses (`prefill_tok_s`), and per strategy: the
    routed experts on the CPU, or streamed to the GPU layer by layer, with the PCIe floor of
    the latter (packed bytes per pass over the pinned host-to-device bandwidth)."""
    overlap = runner.overlap
    streams = runner.planner is not None and runner.planner.can_stream()
    out: dict[str, Any] = {"prefill_tok_s": {}, "prefill_cpu_tok_s": {}}
    if streams:
        out.update(prefill_gpu_tok_s={}, prefill_gpu_floor_tok_s={},
                   h2d_gb_s=round(measure.h2d_bandwidth(runner.device) / 1e9, 1))
    auto = runner.config
    for n in cfg.prefill_lengths:
        key = str(n)
        out["prefill_tok_s"][key] = round(measure.prefill_speed(runner, n, vocab), 1)
        runner.config = dataclasses.replace(auto, prefill_experts="cpu")
        out["prefill_cpu_tok_s"][key] = round(measure.prefill_speed(runner, n, vocab), 1)
        cpu = out["prefill_cpu_tok_s"][key]
        line = f"prefill {n}: {out['prefill_tok_s'][key]} tok/s (cpu {cpu}"
        if streams:
            runner.config = dataclasses.replace(auto, prefill_experts="gpu")
            out["prefill_gpu_tok_s"][key] = round(measure.prefill_speed(runner, n, vocab), 1)
            assert overlap is not None and overlap.streamer is not None
            floor = n * out["h2d_gb_s"] * 1e9 / overlap.streamer.bytes_per_pass()
            out["prefill_gpu_floor_tok_s"][key] = round(floor, 1)
            line += f", gpu {out['prefill_gpu_tok_s'][key]}, PCIe floor {floor:.0f}"
        runner.config = auto
        log(line + ")")
    if streams and overlap is not None and overlap.streamer is not None:
        out["gpu_prefill_bytes_per_pass"] = overlap.streamer.bytes_per_pass()
        out["gpu_prefill_grouped_gemm"] = overlap.streamer.grouped
    return out


def table(results: list[dict[str, Any]]) -> str:
    """A readable table of bench results (one row per decode mode)."""
    rows = [f"{'shape':<24}{'mode':<34}{'tok/s':>9}{'of bound':>10}{'bound':>9}"]
    for r in results:
        c = r["config"]
        for name, entry in r.get("decode", {}).items():
            mode = f"{c['experts']}/{c['weight_format']}/{name}"
            shape = c["shape"] or c["model"]
            bound = r.get("bound_tok_s", float("nan"))
            share = entry.get("of_bound", float("nan"))
            speed = entry.get("tok_s", entry.get("decode_tok_s", float("nan")))
            rows.append(f"{shape:<24}{mode:<34}{speed:>9.2f}{share:>10.3f}{bound:>9.2f}")
        for n, speed in r.get("prefill_tok_s", {}).items():
            mode = f"{c['experts']}/{c['weight_format']}/prefill {n}"
            rows.append(f"{c['shape'] or c['model']:<24}{mode:<34}{speed:>9.1f}")
    return "\n".join(rows)


def now_utc() -> str:
    """The date and minute of a benchmark JSON ("2025-01-31 12:00 UTC")."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_sha() -> str:
    """The source tree's commit, for benchmark JSON (`machine.source_commit`)."""
    return source_commit(Path(__file__).resolve().parents[3])


def machine_facts(device: torch.device) -> dict[str, Any]:
    """CPU model, core count, torch version and the GPU's name, for benchmark JSON."""
    facts: dict[str, Any] = {"cpu": platform.processor() or platform.machine(),
                             "cores": os.cpu_count(), "torch": torch.__version__}
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                                if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return facts
