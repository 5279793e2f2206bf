"""bench_decode_layer.py's projection rows: the decode step's q/k/v (input RMSNorm + GEMV) and
o_proj, cuBLAS behind torch's ops against kernels/norm_gemv.py and kernels/gemv_residual.py, at
each row count, every layer's own weights in one CUDA graph (48 x 21 MB of qkv weights: nothing
stays in L2); and the sweep of the kernels' launch shapes (`GemvConfig`, tensor-core dot or FMA).
Microseconds per call and GB/s of the weights' bytes (the floor's bytes; x and the output are
< 0.1 % of them). Errors against a float64 reference of the same math, in bf16 units of the last
place at the outputs' rms: a scale for sums that cancel (an output near zero has a tiny ulp, and
two orders of fp32 sums, or a normalized x rounded the other way once, differ by many of those
there without either being wrong)."""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from hetmoe.bench.cuda_graphs import capture
from hetmoe.kernels.gemv_config import GEMV_CONFIGS, NORM_GEMV_CONFIGS, GemvConfig, config_for
from hetmoe.kernels.gemv_residual import gemv_residual
from hetmoe.kernels.norm_gemv import norm_gemv
from hetmoe.ops import fused

Layers = list[tuple[Any, ...]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gemv-only", action="store_true",
                   help="the projection rows alone (no layer or router rows)")
    p.add_argument("--gemv-rows", default="1,4,8", help="decode rows of the projection rows")
    p.add_argument("--gemv-shapes", default="",
                   help="sweep the kernels' launch shapes for these projections (qkv,o_proj)")
    p.add_argument("--gemv-block-n", default="4,8,16", help="the sweep's block_n values")
    p.add_argument("--gemv-block-k", default="256,512", help="the sweep's block_k values")
    p.add_argument("--gemv-split", default="1,2", help="the sweep's split_k values")
    p.add_argument("--gemv-warps", default="4", help="the sweep's num_warps values")
    p.add_argument("--gemv-stages", default="4", help="the sweep's num_stages values")
    p.add_argument("--gemv-dot", default="0,1", help="the sweep's dot values (0: FMAs)")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def calls(name: str, layers: Layers, eps: float, path: str,
          config: GemvConfig | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [M, K] -> the last layer's output of projection `name` (qkv: norm + q/k/v; o_proj) over
    every layer's weights, by `path` (cublas: torch's ops, the norm compiled by Inductor as
    the step compiles it; kernel: the Triton kernel at `config`, None its default by rows)."""
    qkv = name == "qkv"
    if path == "cublas" and qkv:
        fn = torch.compile(lambda x, norm, w: fused.linear(fused.rms_norm(x, norm, eps), w, None),
                           fullgraph=True, dynamic=False)
    elif path == "cublas":
        fn = lambda x, norm, w: fused.linear(x, w, None)  # noqa: E731
    elif qkv:
        fn = lambda x, norm, w: norm_gemv(x, norm, eps, w, None, config)  # noqa: E731
    else:
        fn = lambda x, norm, w: gemv_residual(x, w, None, None, config)  # noqa: E731

    def step(x: torch.Tensor) -> torch.Tensor:
        out = x
        for norms, weights, _, _ in layers:
            out = fn(x, norms[0], weights[0] if qkv else weights[4])
        return out

    return step


def timed(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, replays: int,
          trials: int, per: int, replay_seconds: Callable[[Any, int], float]
          ) -> tuple[float, torch.Tensor]:
    """(us per call: the median of `trials` timings of `replays` replays of `step` captured as
    one CUDA graph of `per` calls, the output of an eager run)."""
    step(x)  # compile / warm
    out = step(x)
    graph, _ = capture(lambda: step(x), warmup=0)
    graph.replay()
    us = statistics.median(replay_seconds(graph, replays) / per * 1e6 for _ in range(trials))
    return us, out


def weight_bytes(name: str, layers: Layers) -> int:
    w = layers[0][1][0 if name == "qkv" else 4]
    return w.numel() * w.element_size()


def reference(name: str, layers: Layers, eps: float, x: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] of the last layer's projection of x (qkv: after the exact RMSNorm)."""
    norms, weights, _, _ = layers[-1]
    x64 = x.double()
    if name == "qkv":
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * norms[0].double()
    return x64 @ weights[0 if name == "qkv" else 4].double().T


def rms_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in bf16 units of the last place at want's rms."""
    rms = want.double().pow(2).mean().sqrt()
    unit = torch.exp2(torch.floor(torch.log2(rms)) - 7)
    return float((got.double() - want.double()).abs().max() / unit)


def projection_rows(layers: Layers, eps: float, hidden: int, args: argparse.Namespace,
                    replay_seconds: Callable[[Any, int], float]) -> list[dict[str, Any]]:
    """cuBLAS and the kernel for each projection and row count: us per call, GB/s, the kernel's
    speedup, each path's largest error against float64 and their largest difference (bf16
    units of the last place at the outputs' rms, `rms_ulps`)."""
    rows = []
    for m, name in itertools.product(ints(args.gemv_rows), ("qkv", "o_proj")):
        k = hidden if name == "qkv" else layers[0][1][4].shape[1]
        x = torch.randn(m, k, device="cuda").bfloat16()
        nbytes = weight_bytes(name, layers)
        want = reference(name, layers, eps, x)
        got = {}
        for path in ("cublas", "kernel"):
            us, out = timed(calls(name, layers, eps, path), x, args.replays, args.trials,
                            len(layers), replay_seconds)
            got[path] = out
            rows.append({"projection": name, "rows": m, "path": path, "us_per_call": us,
                         "gb_per_s": nbytes / us / 1e3, "err_ulps": rms_ulps(out, want)})
        rows[-1]["diff_ulps"] = rms_ulps(got["kernel"], got["cublas"])
        rows[-1]["speedup"] = rows[-2]["us_per_call"] / rows[-1]["us_per_call"]
    return rows


def sweep(layers: Layers, eps: float, hidden: int, args: argparse.Namespace,
          replay_seconds: Callable[[Any, int], float]) -> list[dict[str, Any]]:
    """Every launch shape of the grid (and the defaults) for each projection of --gemv-shapes
    at each of --gemv-rows: us per call, GB/s, programs, ratio to the default shape."""
    grid = [GemvConfig(*v[:-1], dot=bool(v[-1])) for v in itertools.product(
        ints(args.gemv_block_n), ints(args.gemv_block_k), ints(args.gemv_split),
        ints(args.gemv_warps), ints(args.gemv_stages), ints(args.gemv_dot))
        if v[-1] == 0 or v[0] >= 16]  # a dot needs 16 rows of W
    rows = []
    for name in args.gemv_shapes.split(","):
        k = hidden if name == "qkv" else layers[0][1][4].shape[1]
        n = layers[0][1][0 if name == "qkv" else 4].shape[0]
        for m in ints(args.gemv_rows):
            default = config_for(NORM_GEMV_CONFIGS if name == "qkv" else GEMV_CONFIGS, m)
            x = torch.randn(m, k, device="cuda").bfloat16()
            spilling = [c for c in grid if c.fma_registers(m) > 128]
            if spilling:
                print(f"gemv {name} M={m}: left out (> 128 fp32 sums a thread): "
                      + " ".join(",".join(str(int(v)) for v in vars(c).values())
                                 for c in spilling), flush=True)
            base = None
            for config in [default, *(c for c in grid if c != default and c not in spilling)]:
                us, _ = timed(calls(name, layers, eps, "kernel", config), x, args.replays,
                              args.trials, len(layers), replay_seconds)
                base = base or us
                rows.append({"projection": name, "rows": m, **vars(config),
                             "programs": config.programs(n), "us_per_call": us,
                             "gb_per_s": weight_bytes(name, layers) / us / 1e3,
                             "ratio_to_default": us / base, "default": config == default})
                print(f"gemv {name} M={m} {tuple(vars(config).values())}: {us:.2f} us",
                      flush=True)
    return rows


def print_rows(rows: list[dict[str, Any]], shapes: list[dict[str, Any]]) -> None:
    print(f"{'projection':<10} {'rows':>4} {'path':<7} {'us/call':>8} {'GB/s':>6} "
          f"{'err ulps':>8} {'speedup':>7} {'diff ulps':>9}  (ulps: bf16, at the outputs' rms)")
    for r in rows:
        extra = f"{r['speedup']:>7.3f} {r['diff_ulps']:>9.3f}" if "speedup" in r else ""
        print(f"{r['projection']:<10} {r['rows']:>4} {r['path']:<7} {r['us_per_call']:>8.2f} "
              f"{r['gb_per_s']:>6.0f} {r['err_ulps']:>8.3f} {extra}")
    if shapes:
        print(f"{'projection':<10} {'rows':>4} {'block_n':>7} {'block_k':>7} {'split':>5} "
              f"{'warps':>5} {'stages':>6} {'dot':>3} {'programs':>8} {'us/call':>8} "
              f"{'GB/s':>6} {'/ default':>9}")
        for r in sorted(shapes, key=lambda r: (r["projection"], r["rows"], r["us_per_call"])):
            print(f"{r['projection']:<10} {r['rows']:>4} {r['block_n']:>7} {r['block_k']:>7} "
                  f"{r['split_k']:>5} {r['num_warps']:>5} {r['num_stages']:>6} "
                  f"{int(r['dot']):>3} {r['programs']:>8} {r['us_per_call']:>8.2f} "
                  f"{r['gb_per_s']:>6.0f} "
                  f"{r['ratio_to_default']:>9.3f}{'  (default)' if r['default'] else ''}")
