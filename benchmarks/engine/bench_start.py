"""Checkpoint to first token: `hetmoe convert` and the start of a converted model, on a real shape.

Writes a random-weight checkpoint of `--shape` as a hub checkpoint is laid out (BF16 safetensors
shards of about 4 GB, experts under their per-expert names; `--num-layers` to fit the disk),
converts it (`hetmoe convert`, `--experts` format), then starts `LLM(OUT)` in a fresh process
twice: with the converted files evicted from the page cache (`posix_fadvise DONTNEED`, no root
needed: cold) and again (warm). Each start reports its seconds (`LLM()` alone; the imports
apart), packed GB/s mapped, host RSS
against the packed bytes plus the non-expert weights (the issue's bound: 1.1x), and the first
token's latency; `--direct` also times `LLM(checkpoint)` (every expert re-read and packed at
start, what a start cost before converting). Prints a table and writes JSON.

    python benchmarks/engine/bench_start.py --shape qwen3-30b-a3b --num-layers 24 --experts int8 \
        --work WORKDIR --out DIR [--direct] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.random_model import STD, weight_std
from hetmoe.bench.shapes import SHAPES, shape_config
from hetmoe.loading.convert import ConvertOptions, convert
from hetmoe.loading.shards import write_shards
from hetmoe.loading.skeleton import build_skeleton
from hetmoe.machine import machine_report

SHARD_BYTES = 4 << 30

_START = """
import json, sys, time
t0 = time.perf_counter()
from hetmoe import LLM
import transformers, torch  # noqa: what LLM() imports on first use
import_s = time.perf_counter() - t0
t0 = time.perf_counter()
llm = LLM(sys.argv[1], device=sys.argv[2], progress=False, max_seq_len=256,
          gpu_expert_bytes=0)  # start.md's starts: no experts copied to the GPU
start_s = time.perf_counter() - t0
t1 = time.perf_counter()
llm.generate([1, 2, 3, 4, 5, 6, 7, 8], max_new_tokens=1)
first_token_s = time.perf_counter() - t1
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda key: int(status[key].split()[0]) * 1024
print(json.dumps({"import_s": import_s, "start_s": start_s, "first_token_s": first_token_s,
                  "rss_bytes": kib("VmRSS"), "peak_rss_bytes": kib("VmHWM")}))
"""


def checkpoint_tensors(config: Any, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, bf16 tensor) of a random checkpoint of `config` in the hub's layout: fused expert
    parameters of the transformers class written per expert (gate/up [I, H], down [H, I])."""
    skeleton = build_skeleton(config, torch.bfloat16)
    layers = int(config.num_hidden_layers)
    gen = torch.Generator(device).manual_seed(0)

    def rand(shape: tuple[int, ...], std: float) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        return out.normal_(0.0, std, generator=gen).to(torch.bfloat16).cpu()

    for name, p in skeleton.named_parameters():
        module, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":  # [E, 2I, H]
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                both = rand((2 * half, p.shape[2]), STD)
                yield f"{module}.{e}.gate_proj.weight", both[:half].clone()
                yield f"{module}.{e}.up_proj.weight", both[half:].clone()
        elif kind == "down_proj" and p.dim() == 3:  # [E, H, I]
            for e in range(p.shape[0]):
                yield f"{module}.{e}.down_proj.weight", rand(tuple(p.shape[1:]), STD)
        elif p.dim() >= 2:
            yield name, rand(tuple(p.shape), weight_std(module, layers))
        else:
            yield name, torch.ones(p.shape, dtype=p.dtype if p.is_floating_point()
                                   else torch.bfloat16) if kind == "weight" else torch.zeros(
                p.shape, dtype=torch.bfloat16)


def write_checkpoint(config: Any, out: Path, device: torch.device) -> int:
    """The random checkpoint written into `out`; returns its bytes."""
    out.mkdir(parents=True, exist_ok=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    write_shards(out, checkpoint_tensors(config, device), SHARD_BYTES)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def evict(directory: Path) -> None:
    """Drops `directory`'s files from the page cache (clean pages; no root needed)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def start(model: Path, device: str) -> dict[str, Any]:
    """One start of `LLM(model)` in a fresh process (so RSS is its own)."""
    done = subprocess.run([sys.executable, "-c", _START, str(model), device],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"LLM({model}) failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--num-layers", type=int, help="default: the shape's")
    parser.add_argument("--experts", default="int8", help="converted expert format")
    parser.add_argument("--work", type=Path, required=True, help="where checkpoints are written")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--direct", action="store_true",
                        help="also time LLM(checkpoint) (experts packed at start)")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = shape_config(args.shape, args.num_layers)
    source, converted = args.work / "checkpoint", args.work / "converted"
    shutil.rmtree(args.work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    gen_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    source_bytes = write_checkpoint(config, source, gen_device)
    write_s = time.perf_counter() - t0
    print(f"checkpoint: {source_bytes / 1e9:.1f} GB in {write_s:.1f} s", flush=True)
    t0 = time.perf_counter()
    convert(source, converted, ConvertOptions(args.experts, None, progress=False))
    convert_s = time.perf_counter() - t0
    manifest = json.loads((converted / "manifest.json").read_text())
    packed, other = int(manifest["experts"]["packed_bytes"]), int(manifest["weights_bytes"])
    print(f"convert: {convert_s:.1f} s ({source_bytes / convert_s / 1e9:.2f} GB/s read), "
          f"{packed / 1e9:.1f} GB packed experts, {other / 1e9:.2f} GB other", flush=True)
    runs: dict[str, Any] = {}
    evict(converted)
    runs["converted_cold"] = start(converted, args.device)
    runs["converted_warm"] = start(converted, args.device)
    if args.direct:
        runs["direct_warm"] = start(source, args.device)
    for name, run in runs.items():
        run["packed_gb_s"] = round(packed / run["start_s"] / 1e9, 2)
        run["rss_over_packed_plus_other"] = round(run["rss_bytes"] / (packed + other), 3)
        print(f"{name}: {json.dumps(run)}", flush=True)
    result = {"shape": args.shape, "layers": int(config.num_hidden_layers),
              "experts": args.experts, "device": args.device, "checkpoint_bytes": source_bytes,
              "checkpoint_write_s": round(write_s, 1), "convert_s": round(convert_s, 1),
              "convert_read_gb_s": round(source_bytes / convert_s / 1e9, 2),
              "packed_bytes": packed, "other_bytes": other, "starts": runs,
              "machine": machine_report()}
    (args.out / "bench_start.json").write_text(json.dumps(result, indent=1))
    print("| start | imports s | LLM() s | packed GB/s | RSS GB | RSS / (packed + other) "
          "| first token s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        print(f"| {name} | {run['import_s']:.1f} | {run['start_s']:.1f} | {run['packed_gb_s']} | "
              f"{run['rss_bytes'] / 1e9:.1f} | {run['rss_over_packed_plus_other']} | "
              f"{run['first_token_s']:.2f} |")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
