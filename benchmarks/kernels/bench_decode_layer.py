"""The fused decode step's GQA layer function alone (no experts, no lm_head), compiled and
replayed as one CUDA graph over every layer of a real shape (random weights, one set per layer,
so nothing stays in L2): with its Triton kernels (kernels/gqa_decode.py, kernels/moe_router.py)
against the same function in torch ops plus its cache write, with the router in its two
launches (no tickets) against its one, and with q/k/v and o_proj by cuBLAS instead of
kernels/norm_gemv.py and kernels/gemv_residual.py ("triton-cublas"); then the router alone
(`moe_router`, every layer's weights, one graph) in one launch against two; then the projections
alone, cuBLAS against the kernels at --gemv-rows rows (decode_gemv_rows.py: us per call, GB/s of
the weights), and with --gemv-shapes qkv,o_proj the kernels' launch-shape sweep. Prints
microseconds and GPU kernels per layer for each, and the step's GPU time without experts; JSON
with --json. --gemv-only: the projection rows alone. --router-only: the router rows alone (no
compiles). --router-shapes: the router's one launch at each launch shape (BLOCK_E x num_warps x
BLOCK_H, the median of --trials timings of its graph), in us per call, the router weights' GB/s
and the ratio to the default shape; shapes whose tile holds more than 128 fp32 a thread are left
out (ptxas spills them; printed).

    python benchmarks/kernels/bench_decode_layer.py [--shape qwen3-30b-a3b] [--batch 1]
        [--position 96] [--window 256] [--replays 50] [--router-only] [--router-shapes
        [--block-e 1,2,4,8,16] [--warps 1,2,4,8] [--block-h 1024,2048] [--trials 5]]
        [--gemv-only] [--gemv-rows 1,4,8] [--gemv-shapes qkv,o_proj [--gemv-block-n 4,8,16]
        [--gemv-block-k 256,512] [--gemv-split 1,2] [--gemv-warps 4] [--gemv-stages 4]
        [--gemv-dot 0,1]]
        [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import decode_gemv_rows
import torch
import triton
from torch._dynamo import mark_dynamic
from torch.profiler import ProfilerActivity, profile

from hetmoe.bench.cuda_graphs import capture
from hetmoe.bench.harness import git_sha
from hetmoe.bench.shapes import shape_config
from hetmoe.engine.executor.fused_decode import FusedDecoder
from hetmoe.engine.executor.layer_functions import make_gqa_layer
from hetmoe.engine.executor.layer_plan import LayerStatics
from hetmoe.kernels.moe_router import (
    ROUTER_BLOCK_E,
    ROUTER_NUM_WARPS,
    launch_shape,
    moe_router,
    row_tickets,
)
from hetmoe.machine import machine_report
from hetmoe.ops import fused
from hetmoe.ops.router import RouterConfig


def statics_of(cfg: Any) -> LayerStatics:
    """A GQA MoE layer's statics from a transformers config (as engine/executor/layer_plan.py
    reads)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eps = float(cfg.rms_norm_eps)
    return LayerStatics("gqa", (eps, eps, eps), cfg.num_attention_heads,
                        (cfg.num_key_value_heads, head_dim), head_dim ** -0.5, "half",
                        RouterConfig.from_hf(cfg))


def layer_inputs(cfg: Any, s: LayerStatics, batch: int, length: int) -> list[tuple[Any, ...]]:
    """Per layer: norms, weights (q/k norms when the family has them), caches, router."""
    kv_heads, d = s.dims
    hidden, qn = cfg.hidden_size, cfg.model_type == "qwen3_moe"
    assert s.router is not None

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * scale).bfloat16()

    layers = []
    for _ in range(cfg.num_hidden_layers):
        norms = (rand(hidden, scale=1.0), rand(hidden, scale=1.0))
        weights = (rand((s.heads + 2 * kv_heads) * d, hidden), None,
                   rand(d, scale=1.0) if qn else None, rand(d, scale=1.0) if qn else None,
                   rand(hidden, s.heads * d))
        cache = rand(batch, length, 2, kv_heads, d, scale=1.0)
        layers.append((norms, weights, (cache,), (rand(s.router.num_experts, hidden), None)))
    return layers


def step_fn(s: LayerStatics, kernel: bool, layers: list[tuple[Any, ...]], pos: torch.Tensor,
            slots: torch.Tensor, cos: torch.Tensor, window: tuple[torch.Tensor, ...],
            tickets: torch.Tensor | None = None, gemv: bool = True) -> Any:
    """h [B, H] -> h after every layer (the MoE output replaced by a fixed term); `tickets`:
    the router's one launch (as FusedDecoder passes them), None: its two; `gemv`: the
    projection kernels where they fit (False: cuBLAS)."""
    fn = torch.compile(make_gqa_layer(s, kernel, gemv), fullgraph=True, dynamic=False)
    extra = () if tickets is None else (tickets,)

    def step(h: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        for norms, weights, caches, router in layers:
            h, _, new, _ = fn(h, (term,), norms, weights, cos, cos, caches, slots, window,
                              (*router, *extra))
            FusedDecoder._write(caches, new, slots, pos)  # the torch path's cache write
        return h

    return step


def graph_of(step: Any, h: torch.Tensor, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`step(h, x)` captured as one CUDA graph (compiled and warm before)."""
    return capture(lambda: step(h, x), warmup=0)[0]


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay of `graph` over `replays` replays back to back."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays


def measure(step: Any, h: torch.Tensor, term: torch.Tensor, replays: int, layers: int
            ) -> dict[str, float]:
    """Microseconds and GPU kernels per layer of `step` as one CUDA graph's replays."""
    for _ in range(2):
        step(h, term)  # compile, then warm
    graph = graph_of(step, h, term)
    graph.replay()
    seconds = replay_seconds(graph, replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.time_range.elapsed_us() for e in kernels)  # the kernels alone
    return {"us_per_layer": seconds / layers * 1e6, "kernels_per_layer": len(kernels) / layers,
            "kernel_us_per_layer": gpu_us / layers, "ms_per_step": seconds * 1e3}


def router_step(s: LayerStatics, layers: list[tuple[Any, ...]], tickets: torch.Tensor | None,
                **shape: int) -> Any:
    """(h, o) [B, H] -> the last layer's stage: `moe_router` alone over every layer's norm and
    router weights (uncompiled: the op's own launches only) at the launch `shape` (none: the
    default); `tickets` None: two launches."""
    assert s.router is not None
    args = s.router.kernel_args()

    def step(h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        stage = h
        for norms, _, _, (weight, bias) in layers:
            _, _, stage = moe_router(h, o, norms[1], s.eps[1], weight, bias, tickets, *args,
                                     **shape)
        return stage

    return step


def ints(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]."""
    return [int(v) for v in text.split(",")]


def router_shapes(s: LayerStatics, layers: list[tuple[Any, ...]], tickets: torch.Tensor,
                  h: torch.Tensor, o: torch.Tensor, args: argparse.Namespace
                  ) -> list[dict[str, Any]]:
    """The one launch's us per call (median of `args.trials` timings of `args.replays` replays
    of one graph over every layer) at each launch shape, the default shape among them, and the
    int32 words of the last layer's stage (x, ids, weights) that differ from the default's."""
    hidden, experts = h.shape[1], layers[0][3][0].shape[0]
    default = (ROUTER_BLOCK_E, ROUTER_NUM_WARPS,
               launch_shape(hidden, ROUTER_BLOCK_E, ROUTER_NUM_WARPS, None))
    grid = sorted(set(itertools.product(ints(args.block_e), ints(args.warps), ints(args.block_h)))
                  | {default})
    weight_bytes = experts * hidden * layers[0][3][0].element_size()  # the floor's bytes
    rows = []
    want = router_step(s, layers, tickets)(h, o)
    for block_e, warps, block_h in grid:
        if block_e * min(block_h, triton.next_power_of_2(hidden)) > 128 * 32 * warps:
            print(f"router shape {block_e} x {warps} warps x {block_h}: left out (spills)")
            continue
        step = router_step(s, layers, tickets, block_e=block_e, num_warps=warps,
                           block_h=block_h)
        step(h, o)  # compile
        differ = int((step(h, o) != want).sum())
        graph = graph_of(step, h, o)
        us = statistics.median(replay_seconds(graph, args.replays) / len(layers) * 1e6
                               for _ in range(args.trials))
        rows.append({"block_e": block_e, "num_warps": warps, "block_h": block_h,
                     "programs": h.shape[0] * -(-experts // block_e), "us_per_call": us,
                     "weights_gb_per_s": weight_bytes / us / 1e3, "stage_words_differing": differ,
                     "default": (block_e, warps, block_h) == default})
        print(f"router shape {block_e} x {warps} warps x {block_h}: {us:.2f} us, {differ} stage "
              f"words differ", flush=True)
    base = next(r["us_per_call"] for r in rows if r["default"])
    for r in rows:
        r["ratio_to_default"] = r["us_per_call"] / base
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--position", type=int, default=96, help="cached entries per row")
    p.add_argument("--window", type=int, default=256, help="attended window (the bucket)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--router-only", action="store_true", help="skip the compiled layer rows")
    p.add_argument("--router-shapes", action="store_true", help="sweep the router's launch shape")
    p.add_argument("--block-e", default="1,2,4,8,16", help="the sweep's BLOCK_E values")
    p.add_argument("--warps", default="1,2,4,8", help="the sweep's num_warps values")
    p.add_argument("--block-h", default="1024,2048", help="the sweep's BLOCK_H values")
    p.add_argument("--trials", type=int, default=5, help="timings per shape (the median)")
    decode_gemv_rows.add_arguments(p)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = shape_config(args.shape)
    s = statics_of(cfg)
    layers = layer_inputs(cfg, s, args.batch, max(args.window, args.position + 1))
    pos = torch.full((args.batch,), args.position, device="cuda")
    slots = torch.arange(args.batch, device="cuda")
    cos = torch.ones(args.batch, 1, s.dims[1], device="cuda", dtype=torch.bfloat16)
    mask = fused.window_mask(pos, args.window, None)
    mark_dynamic(mask, 1)  # as FusedDecoder marks it: one graph for every bucket
    h = torch.randn(args.batch, cfg.hidden_size, device="cuda").bfloat16()
    term = torch.randn(args.batch, cfg.hidden_size, device="cuda") * 0.1
    tickets = row_tickets(args.batch, "cuda")
    bounds = (mask, fused.window_bounds(pos, None), pos)
    rows = {}
    for name, kernel, window, t, gemv in (("torch", False, (mask,), None, False),
                                          ("triton", True, bounds, tickets, True),
                                          ("triton-2", True, bounds, None, True),
                                          ("triton-cublas", True, bounds, tickets, False)):
        if args.router_only or args.gemv_only:
            break
        step = step_fn(s, kernel, layers, pos, slots, cos, window, t, gemv)
        rows[name] = measure(step, h, term, args.replays, cfg.num_hidden_layers)
    o = term.bfloat16()
    for name, t in (("router-1", tickets), ("router-2", None)):
        if args.gemv_only:
            break
        rows[name] = measure(router_step(s, layers, t), h, o, args.replays,
                             cfg.num_hidden_layers)
    shapes = router_shapes(s, layers, tickets, h, o, args) if args.router_shapes else []
    gemv_rows, gemv_shapes = [], []
    if not args.router_only:
        eps = s.eps[0]
        gemv_rows = decode_gemv_rows.projection_rows(layers, eps, cfg.hidden_size, args,
                                                     replay_seconds)
    if args.gemv_shapes:
        gemv_shapes = decode_gemv_rows.sweep(layers, s.eps[0], cfg.hidden_size, args,
                                             replay_seconds)
    if tickets.any():
        raise RuntimeError(f"the router's tickets were not left at zero: {tickets.tolist()}")
    print(f"{args.shape}, batch {args.batch}, {args.position} cached, window {args.window}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'path':<13} {'us/layer':>9} {'kernels/layer':>14} {'kernel us/layer':>16} "
          f"{'ms/step':>8}")
    for name, row in rows.items():
        print(f"{name:<13} {row['us_per_layer']:>9.2f} {row['kernels_per_layer']:>14.1f} "
              f"{row['kernel_us_per_layer']:>16.2f} {row['ms_per_step']:>8.3f}")
    for a, b in (("triton", "torch"), ("triton", "triton-2"), ("triton", "triton-cublas"),
                 ("router-1", "router-2")):
        if a in rows:
            print(f"{a} / {b}: {rows[a]['ms_per_step'] / rows[b]['ms_per_step']:.3f}")
    if shapes:
        print(f"{'BLOCK_E':>7} {'warps':>5} {'BLOCK_H':>7} {'programs':>8} {'us/call':>8} "
              f"{'GB/s':>6} {'/ default':>9} {'words differ':>12}")
        for r in sorted(shapes, key=lambda r: r["us_per_call"]):
            print(f"{r['block_e']:>7} {r['num_warps']:>5} {r['block_h']:>7} {r['programs']:>8} "
                  f"{r['us_per_call']:>8.2f} {r['weights_gb_per_s']:>6.0f} "
                  f"{r['ratio_to_default']:>9.3f} {r['stage_words_differing']:>12}"
                  f"{'  (default)' if r['default'] else ''}")
    if gemv_rows or gemv_shapes:
        decode_gemv_rows.print_rows(gemv_rows, gemv_shapes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "git": git_sha(),
                       "device": torch.cuda.get_device_name(), "machine": machine_report(),
                       "rows": rows, "router_shapes": shapes, "gemv_rows": gemv_rows,
                       "gemv_shapes": gemv_shapes}, f, indent=1)


if __name__ == "__main__":
    main()
