"""The memory `hetmoe bench --random-weights` needs, checked before anything is built.

The plan of `loading/memory_plan.py` for the shape's injected meta skeleton (routed experts
packed on the host, other weights and the KV cache where they will live), plus what the bench
holds besides: one layer's experts staged in bf16 while the backend packs them, the
read-bandwidth probe, and the process itself (torch, activations). A shape that does not fit is
refused with the `--num-layers` that does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hetmoe.bench.shapes import routed_expert_shape, shape_config
from hetmoe.inject.apply import apply_rules
from hetmoe.inject.registry import OpContext
from hetmoe.inject.rules import load_rules, shipped_rules_path
from hetmoe.loading.memory_plan import GB, MemoryPlan, memory_plan
from hetmoe.loading.skeleton import build_skeleton

PROCESS_BYTES = int(0.5 * GB)
"""The bench process without the model (torch, the CPU backend's pool, prefill activations);
with it the plan of qwen3-30b-a3b at 2 layers is 6.0 GB, its measured peak RSS 5.4 GB."""


def bench_plan(shape: str, num_layers: int | None, device: torch.device, weight_format: str,
               kv_tokens: int, probe_bytes: int) -> MemoryPlan:
    """The memory plan of `shape` (with `num_layers`) as the bench builds and runs it."""
    config: Any = shape_config(shape, num_layers)
    skeleton = build_skeleton(config, torch.bfloat16)  # meta: no bytes
    apply_rules(skeleton, load_rules(shipped_rules_path(config.model_type)),
                OpContext(device, torch.bfloat16, config, "cpu"))
    plan = memory_plan(skeleton, device, torch.bfloat16, config, kv_tokens, weight_format)
    experts, hidden, intermediate, _ = routed_expert_shape(shape)
    extra = (("staging (one layer's experts, bf16)", "host", experts * 3 * hidden * intermediate
              * 2), ("read-bandwidth probe", "host", probe_bytes),
             ("process (torch, activations)", "host", PROCESS_BYTES))
    return dataclasses.replace(plan, rows=plan.rows + extra)


def check_memory(shape: str, num_layers: int | None, device: torch.device, weight_format: str,
                 kv_tokens: int, probe_bytes: int) -> MemoryPlan:
    """The plan of the run; ValueError with need vs available and the fitting `--num-layers`
    when it does not fit."""
    plan = bench_plan(shape, num_layers, device, weight_format, kv_tokens, probe_bytes)
    refusal = plan.refusal()
    if not refusal:
        return plan
    layers = num_layers or int(shape_config(shape).num_hidden_layers)
    fits = _layers_that_fit(shape, layers, plan, device, weight_format, kv_tokens, probe_bytes)
    hint = (f"--num-layers {fits} fits" if fits else "not even one layer fits")
    smaller = {"bf16": "int8 or int4", "int8": "int4"}.get(weight_format)
    if smaller:
        hint += f" (or fewer bytes per expert: --weight-format {smaller})"
    raise ValueError(f"bench --random-weights {shape} with {layers} layers: {refusal}; {hint}")


def _layers_that_fit(shape: str, layers: int, full: MemoryPlan, device: torch.device,
                     weight_format: str, kv_tokens: int, probe_bytes: int) -> int:
    """The most decoder layers whose plan fits: linear from 2 layers (a DeepSeek shape's first
    dense layer included) to `layers`, then checked against that plan itself."""
    small = bench_plan(shape, 2, device, weight_format, kv_tokens, probe_bytes)
    if layers <= 2 or small.refusal():
        one = bench_plan(shape, 1, device, weight_format, kv_tokens, probe_bytes)
        return 0 if one.refusal() else 1
    fits = layers - 1
    for place, free in (("host", full.host_free), ("gpu", full.gpu_free)):
        per_layer = (full.total(place) - small.total(place)) / (layers - 2)
        if free is not None and per_layer > 0:
            fits = min(fits, 2 + int((free - small.total(place)) / per_layer))
    fits = max(fits, 2)
    while fits > 2 and bench_plan(shape, fits, device, weight_format, kv_tokens,
                                  probe_bytes).refusal():
        fits -= 1
    return fits
