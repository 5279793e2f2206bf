"""Where a graph-replayed decode step spends its GPU time, module path vs fused path (needs CUDA).

Builds a random-weight model of a real shape (routed experts in the CPU backend), then per decode
path (`module`: the HF layers; `fused`: engine/executor/fused_decode.py, compiled) in ONE process:
- the floor: graph decode with every routed expert masked out of the CPU jobs (ms/token);
- GPU kernels per token by name (torch.profiler over graph replays of that floor): count and
  GPU microseconds per token, the top entries printed;
- graph decode with the real CPU experts at each `--deferred` (tok/s).
Plus two ceilings measured on the same GPU: the per-node cost of a captured graph of tiny
kernels, and device-to-device copy bandwidth (bytes read + written), which with the GPU weight
bytes a step reads gives the GEMV floor.

    python benchmarks/engine/profile_decode.py --shape qwen3-30b-a3b [--weight-format bf16]
        [--deferred 0,3] [--paths module,fused] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.cuda_graphs import capture, event_ms
from hetmoe.bench.gpu_profile import decode_kernels
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import add_shape_arguments, shape_config
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.engine.executor.runner import ModelRunner


def graph_node_us(nodes: int = 400, replays: int = 50) -> float:
    """Microseconds per node of a captured graph of tiny dependent kernels (the median replay,
    after one untimed)."""
    t = torch.zeros(1, device="cuda")

    def chain() -> None:
        for _ in range(nodes):
            t.add_(1)

    graph, _ = capture(chain)
    return statistics.median_high(event_ms(graph.replay, replays, warmup=1)) * 1e3 / nodes


def copy_gb_s(mib: int = 1024) -> float:
    """Device-to-device copy bandwidth, bytes read + written (best of 10)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    best = min(event_ms(lambda: dst.copy_(src), 10)) / 1e3
    return 2 * src.numel() / best / 1e9


def gpu_weight_bytes(model: Any) -> int:
    """Bytes of GPU parameters a decode step reads, embedding rows aside (all but the table)."""
    base = getattr(model, model.base_model_prefix)
    skip = {id(base.embed_tokens.weight)}
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.device.type == "cuda" and id(p) not in skip)


def kernel_table(runner: ModelRunner, prompt: list[int], steps: int) -> dict[str, Any]:
    """GPU activity per token by name over `steps` graph decode steps."""
    profile = decode_kernels(runner, prompt, steps, warmup=3, name_width=90)
    rows = [(r.name, round(r.calls, 2), round(r.us, 1)) for r in profile.rows]
    return {"gpu_us_per_token": round(profile.busy_us, 1),
            "kernels_per_token": round(profile.kernels, 1), "rows": rows}


def measure_path(path: str, model: Any, prompt: list[int], window: int, deferred: list[int],
                 tokens: int) -> dict[str, Any]:
    """Floor, kernel table and real decode speed of one decode path."""
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, torch.device("cuda"), dtype, 1, window,
                         EngineConfig(fused_decode=path == "fused", gpu_expert_bytes=0))
    if path == "fused" and runner.fused is None:
        raise SystemExit("the fused path does not fit this model")
    out: dict[str, Any] = {}
    moes = [cpu_moe_of(m.experts) for m in runner.overlap.layers]
    try:
        for moe in moes:
            moe.set_gpu_experts(torch.ones(moe.num_experts, dtype=torch.bool))
        start = time.perf_counter()
        run = measure.greedy_decode(runner, prompt, tokens)
        out["first_run_s"] = round(time.perf_counter() - start, 1)  # compile + capture
        out["floor_ms_per_token"] = round(1e3 / run.tok_s, 3)
        out["floor_us_per_layer"] = round(1e6 / run.tok_s / len(runner.fused.plans
                                          if runner.fused else runner.base.layers), 1)
        out["profile"] = kernel_table(runner, prompt, 4)
    finally:
        for moe in moes:
            moe.set_gpu_experts(None)
    for d in deferred:
        runner.reset_graphs(d)
        run = measure.greedy_decode(runner, prompt, tokens)
        out[f"graph_d{d}_tok_s"] = round(run.tok_s, 2)
        out[f"graph_d{d}_ms_per_token"] = round(1e3 / run.tok_s, 3)
    runner.overlap.detach()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--paths", default="module,fused")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA device", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"shape": args.shape, "weight_format": args.weight_format,
                              "gpu": torch.cuda.get_device_name(),
                              "graph_node_us": round(graph_node_us(), 3),
                              "d2d_copy_gb_s": round(copy_gb_s(), 1)}
    config = shape_config(args.shape, args.num_layers)
    model = build_random_model(config, torch.device("cuda"), torch.bfloat16, "cpu",
                               args.weight_format, 0)
    result["gpu_weight_bytes_per_token"] = gpu_weight_bytes(model)
    result["gemv_floor_ms"] = round(result["gpu_weight_bytes_per_token"]
                                    / (result["d2d_copy_gb_s"] / 2 * 1e9) * 1e3, 3)
    prompt = list(range(1, 33))
    deferred = [int(d) for d in args.deferred.split(",") if d]
    for path in args.paths.split(","):
        result[path] = measure_path(path, model, prompt, 32 + args.tokens + 8, deferred,
                                    args.tokens)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"graph node {result['graph_node_us']} us, D2D copy {result['d2d_copy_gb_s']} GB/s, "
          f"GPU weights {result['gpu_weight_bytes_per_token'] / 1e9:.2f} GB/token -> GEMV floor "
          f"{result['gemv_floor_ms']} ms/token")
    for path in args.paths.split(","):
        r = result[path]
        speeds = ", ".join(f"d={d} {r[f'graph_d{d}_tok_s']} tok/s" for d in deferred)
        print(f"{path}: floor {r['floor_ms_per_token']} ms/token ({r['floor_us_per_layer']} "
              f"us/layer), {r['profile']['kernels_per_token']} kernels/token, GPU busy "
              f"{r['profile']['gpu_us_per_token']} us/token; {speeds}; first run "
              f"{r['first_run_s']} s")
        for name, count, us in r["profile"]["rows"][:14]:
            print(f"   {us:9.1f} us {count:7.1f}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
