"""The decode measurements of a `hetmoe bench` run in mode `cpu` (bench/harness.py's `run_bench`):
greedy decode per `deferred` value against the bound and the reads around it, the graph
variants (without CPU work, eager, the HF layers' module path), a trace of eager steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.bench_config import BenchConfig
from hetmoe.bench.trace import TraceRecorder
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import MoEOverlap, cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner


def decode_each_deferred(runner: ModelRunner, cfg: BenchConfig, prompt: list[int],
                         result: dict[str, Any],
                         log: Callable[[str], None]) -> dict[str, list[int]]:
    """Greedy decode for each `cfg.deferred` value (`result["decode"]`) and the attention
    windows its steps used (`result["decode_windows"]`); the tokens of each mode."""
    from hetmoe import _cpu  # the C++ extension: only the cpu mode, which has it, gets here

    result["decode"] = decode = {}
    tokens: dict[str, list[int]] = {}
    probe = int(cfg.bandwidth_gib * 2**30)
    for d in cfg.deferred:
        runner.reset_graphs(d)
        name = f"{'graph' if runner.use_graphs else 'eager'}_d{d}"
        before = _cpu.read_bandwidth(probe, 5) / 1e9
        run = measure.greedy_decode(runner, prompt, cfg.new_tokens)
        after = _cpu.read_bandwidth(probe, 5) / 1e9
        decode[name], tokens[name] = decode_entry(run, result["bound_tok_s"]), run.tokens
        # The host's bandwidth drifts within a run (other tenants of the machine): the pool's
        # reads just before and after this decode give a bound of the same minutes too.
        decode[name]["read_gb_s_around"] = [round(before, 1), round(after, 1)]
        decode[name]["of_adjacent_bound"] = round(
            run.tok_s * result["routed_bytes_per_token"] / (max(before, after) * 1e9), 3)
        log(f"decode {name}: {decode[name]['tok_s']} tok/s "
            f"({decode[name]['of_adjacent_bound']:.1%} of the reads around it)")
    result["decode_windows"] = windows = decode_windows(runner)
    log(f"decode attention windows (bucket: steps): {windows['steps']}")
    return tokens


def graph_variants(runner: ModelRunner, model: Any, cfg: BenchConfig, prompt: list[int],
                   window: int, result: dict[str, Any], tokens: dict[str, list[int]],
                   log: Callable[[str], None]) -> None:
    """With CUDA graphs: decode without CPU work (the runtime's floor); with `cfg.eager`, eager
    decode and launches per token; with `cfg.alternatives` too, the HF layers' module path."""
    decode = result["decode"]
    device, dtype = runner.device, next(model.parameters()).dtype
    if runner.use_graphs:
        runner.reset_graphs(0)
        run = without_cpu_work(runner, prompt, cfg.new_tokens)
        decode["graph_d0_no_cpu_work"] = decode_entry(run, result["bound_tok_s"])
        log(f"decode graph_d0_no_cpu_work: {decode['graph_d0_no_cpu_work']['tok_s']} tok/s")
    if cfg.eager and runner.use_graphs:
        runner.reset_graphs(0)
        result["launches"] = {"graph": measure.count_launches(runner, prompt, 8)}
        runner.use_graphs = False
        run = measure.greedy_decode(runner, prompt, cfg.new_tokens)
        decode["eager_d0"], tokens["eager_d0"] = decode_entry(run, result["bound_tok_s"]), \
            run.tokens
        result["launches"]["eager"] = measure.count_launches(runner, prompt, 8)
        if "graph_d0" in tokens:
            result["graph_eager_same_tokens"] = tokens["graph_d0"] == tokens["eager_d0"]
        runner.use_graphs = True
        log(f"decode eager_d0: {decode['eager_d0']['tok_s']} tok/s")
    if cfg.eager and cfg.alternatives and runner.use_graphs:
        # Before the fused decode (engine/executor/fused_decode.py): the HF layers, same process.
        module = ModelRunner(model, device, dtype, 1, window,
                             EngineConfig(fused_decode=False,
                                          gpu_expert_bytes=cfg.gpu_expert_bytes))
        run = measure.greedy_decode(module, prompt, cfg.new_tokens)
        decode["graph_d0_module_path"] = decode_entry(run, result["bound_tok_s"])
        run = without_cpu_work(module, prompt, cfg.new_tokens)
        decode["graph_d0_no_cpu_work_module_path"] = decode_entry(run, result["bound_tok_s"])
        result["launches"]["graph_module_path"] = measure.count_launches(module, prompt, 8)
        del module  # `runner` re-attaches its own MoE step at its next pass
        runner.reset_graphs()  # the runners above re-allocated the KV caches the graphs baked in
        log(f"decode graph_d0_module_path: {decode['graph_d0_module_path']['tok_s']} tok/s, "
            f"no CPU work {decode['graph_d0_no_cpu_work_module_path']['tok_s']} tok/s")


def decode_windows(runner: ModelRunner) -> dict[str, Any]:
    """The attention window buckets the decode steps so far used, and the capture time of each
    graph of the last `deferred` value."""
    return {"max_seq_len": runner.max_seq_len, "smallest": runner.config.smallest_window,
            "steps": {str(w): n for w, n in sorted(runner.windows.items())},
            "capture_ms": {f"b{b}_w{w}": round(g.capture_s * 1e3, 1)
                           for (b, w), g in sorted(runner.graphs.items())}}


def overlap_of(runner: ModelRunner) -> MoEOverlap:
    if runner.overlap is None:
        raise ValueError("this benchmark mode needs every MoE layer's experts in the cpu backend")
    return runner.overlap


def without_cpu_work(runner: ModelRunner, prompt: list[int],
                      new_tokens: int) -> measure.DecodeRun:
    """Decode with every routed expert masked out of the CPU jobs: the runtime's floor (GPU
    work, copies, signals, CPU jobs that route nothing). Its tokens mean nothing."""
    moes = [cpu_moe_of(m.experts) for m in overlap_of(runner).layers]
    for moe in moes:
        moe.set_gpu_experts(torch.ones(moe.num_experts, dtype=torch.bool))
    try:
        return measure.greedy_decode(runner, prompt, new_tokens)
    finally:
        for moe in moes:
            moe.set_gpu_experts(None)


def decode_entry(run: measure.DecodeRun, bound: float) -> dict[str, Any]:
    return {"tok_s": round(run.tok_s, 2), "mean_tok_s": round(run.mean_tok_s, 2),
            "ms_per_token": round(1e3 / run.tok_s, 3), "of_bound": round(run.tok_s / bound, 3),
            "timed_steps": len(run.step_s), "prompt_prefill_s": round(run.prefill_s, 4)}


def trace_steps(runner: ModelRunner, prompt: list[int], path: str,
                steps: int = 4) -> dict[str, Any]:
    """Eager decode steps with trace marks; writes the Chrome trace, returns its summary."""
    recorder = TraceRecorder(runner.device.type == "cuda")
    graphs, runner.use_graphs = runner.use_graphs, False
    slot = runner.cache.allocate()
    try:
        token = measure.first_token(runner, slot, prompt)
        token = measure.next_token(runner, slot, token)  # warm-up, untraced
        overlap_of(runner).trace = recorder
        for _ in range(steps):
            recorder.begin_step()
            token = measure.next_token(runner, slot, token)
    finally:
        overlap_of(runner).trace = None
        runner.use_graphs = graphs
        runner.free(slot)
    return {"file": path, "steps": steps, "deferred": overlap_of(runner).deferred,
            **recorder.write(path)}
