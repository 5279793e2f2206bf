"""LoRA training throughput on a random-weight model of real shape, against the CPU experts' floor.

The model of `--shape` (random weights, routed experts packed in `--weight-format` in the CPU
backend, the rest on the GPU when there is one) gets LoRA adapters as `hetmoe sft` does
(train/lora.py `attach_lora`, `SftConfig`'s defaults: AdamW, gradient clipping, cosine schedule)
and trains on random token rows of `--seq-len` x `--batch` (labels = inputs): `--warmup` steps,
then `--steps` timed ones, each split into forward (loss), backward and optimizer seconds.
Activations bf16 on a GPU, fp32 on the CPU (as sft; `--dtype` to choose): the experts' forward
is the inference kernels (AMX where there is AMX) for bf16, `expert_forward_fp32` for fp32; the
backward is `expert_backward` in the activations' math (bf16: the forward's kernels, AMX tiles
where an expert has enough rows; fp32: fp32 GEMMs on AVX-512).

Floor: the routed experts' CPU work of one step, timed in the same run on MoE layer 0 alone
through the op training calls (`BackendLink` -> `RoutedExperts`, forward then autograd
backward) on the same token count with uniform random top-k routing, times the MoE layers.
FLOPs counted per (token, expert) pair, as csrc/moe/backward_job.cpp computes them:
    forward                     gate/up x W_gu^T 4 H I + down h W_down^T 2 H I       6 H I
    backward  recompute gate/up x W_gu^T (nothing is kept from the forward)       4 H I
              dA = dY W_down                                                      2 H I
              dx = [dg, du] W_gu                                                  4 H I  = 10 H I
(SiLU, dweights = <dA, h> and the slot sums not counted). The share of the floor is floor
seconds / step seconds (1 = the step costs no more than its CPU expert work).

Also: host read bandwidth (before the CPU pool starts), GPU peak memory, host RSS (current and
peak), and with `--trace` one more step under torch.profiler (CPU + CUDA) as a Chrome trace,
with `cpu_experts fwd L<i>` ranges around each MoE layer's forward (the host waits there for
the CPU experts) and autograd's `RoutedExpertsBackward` nodes, beside the GPU kernels; its GPU
busy, CPU experts busy and both-busy seconds go into the JSON (the CPU experts run on the
backend's pool threads, which the profiler does not see: the ranges are the host thread waiting
for them). `--deadline` (seconds from the start) stops the timed steps once the next one would
end past it, at least one timed, and skips the trace unless two steps' time is left; the JSON is
still written.

    python benchmarks/training/bench_sft.py --shape qwen3-30b-a3b --weight-format int8 \
        --seq-len 2048 --out DIR [--num-layers N] [--steps 3] [--warmup 2]
        [--trace DIR/trace.json.gz]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench.measure import read_bandwidth, sync
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import SHAPES, shape_config
from hetmoe.experts.backend import backends
from hetmoe.machine import machine_report, source_commit
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.moe_step import backend_link
from hetmoe.presets.tiny import tiny_config
from hetmoe.train.lora import attach_lora
from hetmoe.train.sft import SftConfig

FORMATS = ("bf16", "int8", "int4")
FLOPS_PER_PAIR = {"forward": 6, "backward": 10}
"""FLOPs per (token, expert) pair, in units of H I (the module doc)."""


class Clock:
    """Seconds since the run started; progress lines stamped with them (flushed, so a run cut
    short still shows where it was)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.now():7.1f} s] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[*sorted(SHAPES), "tiny"],
                    help="tiny: the baby qwen3_moe of the tests (H 64, 8 experts)")
    ap.add_argument("--num-layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--weight-format", default="int8", choices=FORMATS)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="activations (auto: bf16 on a GPU, fp32 on the CPU, as sft)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="rows per forward")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rate-repeats", type=int, default=3,
                    help="timed forward+backward calls of one layer's experts (median)")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0)
    ap.add_argument("--deadline", type=float, help="seconds from start: no step ends past it")
    ap.add_argument("--trace", type=Path, help="Chrome trace of one more step (.json[.gz])")
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_sft.json")
    args = ap.parse_args(argv)
    for name, least in (("num_layers", 1), ("seq_len", 2), ("batch", 1), ("steps", 1),
                        ("warmup", 0), ("rate_repeats", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            ap.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if args.bandwidth_gib <= 0 or (args.deadline is not None and args.deadline <= 0):
        ap.error("--bandwidth-gib and --deadline must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file; give a directory")
    if args.trace is not None and (args.trace.is_dir() or args.trace.suffix not in (".json",
                                                                                    ".gz")):
        ap.error(f"--trace {args.trace}: expected a file path ending in .json or .json.gz")
    if "cpu" not in backends():
        ap.error("the C++ CPU expert backend (hetmoe._cpu) is not built")
    return args


def model_config(shape: str, num_layers: int | None) -> Any:
    if shape == "tiny":
        return tiny_config("qwen3_moe", num_layers=num_layers)
    return shape_config(shape, num_layers)


def host_memory_gib() -> dict[str, float]:
    """This process's resident set now and at its peak (/proc VmRSS and VmHWM: what psutil
    reads, and psutil has no peak)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    return {name: round(int(fields[key].split()[0]) / 2**20, 2)  # kB
            for name, key in (("host_rss_gib", "VmRSS"), ("host_peak_rss_gib", "VmHWM"))}


class Trainer:
    """One training step as sft runs it, timed per phase."""

    def __init__(self, model: Any, args: argparse.Namespace, device: torch.device) -> None:
        from transformers import get_cosine_schedule_with_warmup

        self.sft = SftConfig(seq_len=args.seq_len)
        torch.manual_seed(self.sft.seed)
        self.model = attach_lora(model, self.sft.lora)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.sft.lr,
                                           weight_decay=self.sft.weight_decay)
        total = args.warmup + args.steps + 1
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, 0, total)
        self.device, self.args = device, args
        self.vocab = int(model.config.vocab_size)

    def step(self, index: int) -> dict[str, float]:
        """Forward, backward, optimizer seconds and the loss of one step on a fresh random row."""
        g = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab, (self.args.batch, self.args.seq_len), generator=g)
        ids = ids.to(self.device)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.profiler.record_function("forward"):
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
            sync(self.device)
        t1 = time.perf_counter()
        with torch.profiler.record_function("backward"):
            loss.backward()
            sync(self.device)
        t2 = time.perf_counter()
        with torch.profiler.record_function("optimizer"):
            if self.sft.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.params, self.sft.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            sync(self.device)
        t3 = time.perf_counter()
        times = {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                 "step_s": t3 - t0, "loss": float(loss.detach())}
        return {k: round(v, 5) for k, v in times.items()}


def expert_layer_s(moe: Any, tokens: int, dtype: torch.dtype,
                   repeats: int) -> dict[str, float]:
    """Median seconds of MoE layer `moe`'s routed experts, forward and backward, on `tokens`
    rows with uniform random top-k routing, through the link training uses (one untimed call
    first)."""
    spec, k = moe.experts.spec, moe.gate.config.top_k
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, spec.hidden_size, generator=g).to(dtype).requires_grad_()  # [T, H]
    ids = torch.rand(tokens, spec.num_experts, generator=g).argsort(dim=1)[:, :k]  # [T, K]
    weights = torch.rand(tokens, k, generator=g).softmax(dim=1).requires_grad_()  # [T, K]
    dy = torch.randn(tokens, spec.hidden_size, generator=g).to(dtype)  # [T, H]
    link = backend_link(moe)
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        link.start(x, ids, weights)
        out = link.finish()
        t1 = time.perf_counter()
        out.backward(dy)
        t2 = time.perf_counter()
        times["forward"].append(t1 - t0)
        times["backward"].append(t2 - t1)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def traced_step(trainer: Trainer, index: int, layers: list[Any],
                path: Path) -> dict[str, Any]:
    """One step under torch.profiler, written as a Chrome trace; busy seconds by side."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ranges: dict[int, Any] = {}
    hooks = []
    for i, moe in enumerate(layers):
        def enter(mod: Any, inputs: Any, i: int = i) -> None:
            ranges[i] = record_function(f"cpu_experts fwd L{i}").__enter__()

        def leave(mod: Any, inputs: Any, output: Any, i: int = i) -> None:
            ranges.pop(i).__exit__(None, None, None)

        hooks += [moe.register_forward_pre_hook(enter), moe.register_forward_hook(leave)]
    try:
        with profile(activities=activities) as prof:
            with record_function("train_step"):
                times = trainer.step(index)
    finally:
        for hook in hooks:
            hook.remove()
    written = time.perf_counter()
    prof.export_chrome_trace(str(path))
    spans: dict[str, list[tuple[float, float]]] = {"gpu": [], "experts": [], "step": []}
    for e in prof.events():
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans["gpu"].append(span)
        elif e.name.startswith("cpu_experts fwd") or "RoutedExpertsBackward" in e.name:
            spans["experts"].append(span)
        elif e.name == "train_step":
            spans["step"].append(span)
    gpu, experts = union(spans["gpu"]), union(spans["experts"])
    return {"file": str(path), "step_s": round(times["step_s"], 3),
            "profiled_step_s": round(sum(b - a for a, b in union(spans["step"])), 3),
            "gpu_busy_s": round(sum(b - a for a, b in gpu), 3),
            "cpu_experts_busy_s": round(sum(b - a for a, b in experts), 3),
            "both_busy_s": round(overlap(gpu, experts), 3),
            "write_s": round(time.perf_counter() - written, 1)}


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering `spans`."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def git_sha() -> str:
    return source_commit(Path(__file__).resolve().parents[2])


def measure_rates(moe: Any, tokens: int, dtype: torch.dtype, repeats: int,
                  num_layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(rates, floor): one layer's CPU experts forward and backward (`expert_layer_s`) as
    seconds and GFLOP/s, and the step's floor over `num_layers` MoE layers."""
    seconds = expert_layer_s(moe, tokens, dtype, repeats)
    pairs = tokens * moe.gate.config.top_k
    hi = moe.experts.spec.hidden_size * moe.experts.spec.intermediate_size
    rates: dict[str, Any] = {}
    for name, per_pair in FLOPS_PER_PAIR.items():
        flops = per_pair * hi * pairs
        rates[name] = {"layer_s": round(seconds[name], 7), "flops_per_layer": flops,
                       "gflop_s": round(flops / seconds[name] / 1e9, 1)}
    rates["flops_per_pair"] = {k: f"{v} H I" for k, v in FLOPS_PER_PAIR.items()}
    rates["routing"] = "uniform random top-k, MoE layer 0"
    floor_s = num_layers * (seconds["forward"] + seconds["backward"])
    floor = {"flops_per_step": num_layers * sum(FLOPS_PER_PAIR.values()) * hi * pairs,
             "seconds": round(floor_s, 6), "tokens_per_s": round(tokens / floor_s, 2)}
    return rates, floor


def timed_steps(trainer: Trainer, args: argparse.Namespace, clock: Clock,
                expected: float) -> tuple[list[dict[str, float]], bool]:
    """Up to `args.steps` timed steps (at least one) and whether the deadline stopped them;
    `expected`: a step's seconds until one is timed."""
    timed: list[dict[str, float]] = []
    for n in range(args.steps):
        if args.deadline is not None and timed and clock.now() + expected > args.deadline:
            clock.log(f"deadline {args.deadline} s: stopping after {len(timed)} timed steps")
            return timed, True
        timed.append(trainer.step(args.warmup + n))
        expected = statistics.median([s["step_s"] for s in timed])
        t = timed[-1]
        clock.log(f"step {n + 1}/{args.steps}: {t['step_s']:.2f} s (forward "
                  f"{t['forward_s']:.2f}, backward {t['backward_s']:.2f}, optimizer "
                  f"{t['optimizer_s']:.3f}), loss {t['loss']:.3f}")
    return timed, False


def gpu_memory_gib(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved GPU memory since the last reset (none on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark (module doc); prints the table, writes and returns the JSON."""
    clock = Clock()
    args = parse_args(argv)
    config = model_config(args.shape, args.num_layers)
    if args.seq_len > config.max_position_embeddings:
        raise SystemExit(f"--seq-len {args.seq_len} exceeds shape {args.shape}'s "
                         f"max_position_embeddings {config.max_position_embeddings}")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and cuda)  # as sft
    dtype = torch.bfloat16 if bf16 else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("hetmoe.bench.random_model").setLevel(logging.INFO)  # per-layer progress
    read_gb_s = read_bandwidth(args.bandwidth_gib)  # before the CPU pool spins
    clock.log(f"host read bandwidth {read_gb_s:.1f} GB/s; building {args.shape} "
              f"({config.num_hidden_layers} layers, {args.weight_format} experts) on {device}")
    began = clock.now()
    model = build_random_model(config, device, dtype, "cpu", args.weight_format)
    build_s = clock.now() - began
    layers = moe_layers(model)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(model, args, device)
    trainable = sum(p.numel() for p in trainer.params)
    clock.log(f"model built ({build_s:.1f} s), LoRA attached: {trainable / 1e6:.2f} M "
              f"trainable parameters; {host_memory_gib()}")
    tokens = args.seq_len * args.batch
    warm = []
    for n in range(args.warmup):
        warm.append(trainer.step(n))
        clock.log(f"warm-up step {n + 1}/{args.warmup}: {warm[-1]['step_s']:.2f} s, "
                  f"loss {warm[-1]['loss']:.3f}")
    rates, floor = measure_rates(layers[0], tokens, dtype, args.rate_repeats, len(layers))
    clock.log(f"one layer's CPU experts on {tokens} tokens: " + ", ".join(
        f"{name} {rates[name]['layer_s'] * 1e3:.1f} ms ({rates[name]['gflop_s']} GFLOP/s)"
        for name in FLOPS_PER_PAIR) + f"; floor {floor['seconds']:.2f} s per step")
    expected = statistics.median([s["step_s"] for s in warm]) if warm else 0.0
    timed, hit = timed_steps(trainer, args, clock, expected)
    expected = statistics.median([s["step_s"] for s in timed])
    trace = None
    if args.trace is not None:
        # The profiled step runs slower and its events take a while to write out.
        if args.deadline is not None and clock.now() + 2 * expected > args.deadline:
            hit = True
            clock.log("deadline: no trace step")
        else:
            trace = traced_step(trainer, args.warmup + args.steps, layers, args.trace)
            clock.log(f"trace written to {args.trace}: {trace}")
    median = {k: round(statistics.median([s[k] for s in timed]), 5)
              for k in ("forward_s", "backward_s", "optimizer_s", "step_s")}
    spec = layers[0].experts.spec
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git": git_sha(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "layers": int(config.num_hidden_layers), "moe_layers": len(layers),
        "experts": spec.num_experts, "top_k": int(layers[0].gate.config.top_k),
        "hidden": spec.hidden_size, "expert_width": spec.intermediate_size,
        "tokens_per_step": tokens, "trainable_params": trainable,
        "lora": trainer.sft.record()["lora"], "build_s": round(build_s, 1),
        "read_gb_s": round(read_gb_s, 1), "warmup_steps": warm, "steps": timed, **median,
        "tokens_per_s": round(tokens / median["step_s"], 2),
        "expert_rate": rates, "floor": floor,
        "of_floor": round(floor["seconds"] / median["step_s"], 4),
        "memory": {"gpu_weights_gib": round(weights_gib, 2), **gpu_memory_gib(device),
                   **host_memory_gib()},
        "trace": trace, "deadline": {"seconds": args.deadline, "hit": hit},
        "machine": machine_report(), "wall_s": round(clock.now(), 1),
    }
    (args.out / "bench_sft.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result), flush=True)
    del trainer, model, layers
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def table(r: dict[str, Any]) -> str:
    """The result as markdown: the step against its floor, then the CPU experts' rates."""
    m = r["memory"]
    rows = [
        f"{r['config']['shape']}, {r['layers']} layers, {r['config']['weight_format']} experts, "
        f"{r['tokens_per_step']} tokens/step, {r['device']} {r['dtype']}, "
        f"{len(r['steps'])} timed steps (median)",
        "",
        "| step s | forward s | backward s | optimizer s | tokens/s | floor s | of floor "
        "| GPU peak GiB | host RSS GiB (peak) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['step_s']:.3f} | {r['forward_s']:.3f} | {r['backward_s']:.3f} "
        f"| {r['optimizer_s']:.3f} | {r['tokens_per_s']:.1f} | {r['floor']['seconds']:.3f} "
        f"| {r['of_floor']:.1%} | {m.get('gpu_peak_allocated_gib', '-')} "
        f"| {m['host_rss_gib']} ({m['host_peak_rss_gib']}) |",
        "",
        f"| CPU experts, one layer ({r['expert_rate']['routing']}) | FLOP/pair | ms | GFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    for name in FLOPS_PER_PAIR:
        rate = r["expert_rate"][name]
        rows.append(f"| {name} | {r['expert_rate']['flops_per_pair'][name]} "
                    f"| {rate['layer_s'] * 1e3:.1f} | {rate['gflop_s']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
