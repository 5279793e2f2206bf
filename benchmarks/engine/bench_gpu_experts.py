"""Decode and prefill speed per GPU expert budget (engine/placement/slots.py), one model build.

For each budget (GB of packed experts resident on the GPU; `all` = every expert) the runner is
re-placed (`ModelRunner.place`), a greedy decode timed (median step, first step untimed) per
Expert Deferral value and, with `--prefill`, each prompt length's prefill per `prefill_experts`
mode. The floor of each decode row: the CPU reads the misses' bytes per token at the host's
measured read bandwidth (before the build), the GPU its resident experts' bytes at HBM speed, so
floor_tok_s = 1 / max(cpu_bytes / host_bw, gpu_bytes / hbm_bw) (the rest of the step, attention
and launches, comes on top: `no_cpu_work` of hetmoe bench says how much). The JSON is written
after every budget. llama.cpp beside it, same budgets, one command:
benchmarks/engine/gpu_experts_sweep.py.

    python benchmarks/engine/bench_gpu_experts.py --shape qwen3-30b-a3b --weight-format int8 \\
        --budgets 0,8,15,23,all --prefill 4096,16384 --json gpu_experts.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hetmoe.bench import measure
from hetmoe.bench.budget_peer import budget_bytes, parse_budgets
from hetmoe.bench.budget_report import plot
from hetmoe.bench.gpu_profile import kernel_profile
from hetmoe.bench.harness import git_sha, machine_facts, now_utc
from hetmoe.bench.random_model import build_random_model
from hetmoe.bench.shapes import shape_config
from hetmoe.config import DEFER_ORDERS, EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.expert_split import PrefillTuner
from hetmoe.engine.placement.placement_compute import use_kernel
from hetmoe.engine.placement.placement_policy import TrafficPolicy

# Where two decode runs part: the graph device checks' helper, which lives with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
from graph_device_row import Decoded, diverged  # noqa: E402

GB = 1e9


def hbm_read_gb_s(device: torch.device, gib: float = 4.0) -> float:
    """GPU memory read bandwidth: best of 5 sums over a `gib` GiB tensor."""
    data = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        data.sum(dtype=torch.float32)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del data
    return int(gib * 2**30) / best / GB


def profile_steps(runner: ModelRunner, prompt: list[int], steps: int = 16) -> dict[str, Any]:
    """GPU time per kernel name of `steps` greedy graph steps alone: a run of steps + 1 tokens
    minus a run of 1 (the prompt's prefill and the first step cancel out). Returns the kernels
    per step, the GPU busy time per step and the top 30 names [(name, calls/step, us/step)]."""
    measure.greedy_decode(runner, prompt, 4)  # graphs captured before profiling
    base = kernel_profile(lambda: measure.greedy_decode(runner, prompt, 2), 1)
    full = kernel_profile(lambda: measure.greedy_decode(runner, prompt, steps + 2), 1)
    per_step = full.minus(base, steps)
    busy, count = per_step.busy_us, per_step.calls
    print(f"GPU busy {busy:.0f} us/step over {count:.0f} kernels/step")
    if runner.fused is not None and runner.fused.dependent:
        print("  (programmatic dependent launches: a kernel's time includes its wait for the one "
              "before it)")
    for r in per_step.rows[:30]:
        print(f"{r.us:9.1f} us/step {r.calls:6.1f} calls/step  {r.name[:90]}")
    return {"busy_us_per_step": round(busy, 1), "kernels_per_step": round(count, 1),
            "top": [(r.name[:120], round(r.calls, 2), round(r.us, 1)) for r in per_step.rows[:30]]}


def record_picks(planner: Any) -> list[int]:
    """The list that each later `planner.gpu_experts` call appends its k to (until
    `del planner.gpu_experts` gives the method back)."""
    chosen: list[int] = []
    pick = planner.gpu_experts

    def recorded(tokens: int, mode: str = "auto") -> int:
        chosen.append(pick(tokens, mode))
        return chosen[-1]

    planner.gpu_experts = recorded
    return chosen


def prefill_rows(runner: ModelRunner, lengths: list[int], modes: list[str], repeats: int,
                 vocab: int, everything: bool) -> list[dict[str, Any]]:
    """Prefill tok/s of each length under the current placement, per `prefill_experts` mode:
    auto (the engine's pick; a fresh tuner per placement, since the old one's timings were of
    another placement) and cpu (the resident experts on the GPU, the misses on the CPU: the
    placement's own path). With every expert resident both are the same path: auto alone.
    Every mode times `repeats` passes (best of); auto first runs untimed passes until its tuner
    has settled the length (`measure.settle_prefill`; their count is `tuning_passes`, 0 for the
    other modes), so its figure is the split it settled on, not a trial's. Each row also lists
    the GPU expert count k of every timed pass (0: the resident path)."""
    planner = runner.planner
    assert planner is not None
    rows = []
    for mode in modes if not everything else ["auto"]:
        runner.config = dataclasses.replace(runner.config, prefill_experts=mode)
        planner.tuner = PrefillTuner()
        chosen = record_picks(planner)
        try:
            for n in lengths:
                settled = measure.settle_prefill(runner, n, vocab) if mode == "auto" else 0
                chosen.clear()  # the timed passes' picks alone
                tok_s = measure.prefill_speed(runner, n, vocab, repeats)
                rows.append({"mode": mode, "tokens": n, "tok_s": round(tok_s, 1),
                             "tuning_passes": settled, "gpu_experts_per_pass": list(chosen)})
                print(f"  prefill {n:>6} ({mode}): {tok_s:8.1f} tok/s, k per pass {chosen}",
                      flush=True)
        finally:
            del planner.gpu_experts  # the method again
    runner.config = dataclasses.replace(runner.config, prefill_experts="auto")
    return rows


def write(result: dict[str, Any], path: str | None) -> None:
    """The result so far (after every budget: a run cut short keeps its rows)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


@contextlib.contextmanager
def pair_config(fmt: str, shape: Any) -> Iterator[tuple[int | bool, ...]]:
    """The pair kernels' launch shapes of `fmt` (kernels/pair_config.py: `PAIR_CONFIGS` and
    `ONE_TOKEN_PAIR_CONFIGS`) all set to `shape` (None: as shipped) for graphs captured inside
    the block; yields the fields of the shape one token launches (decode at batch 1)."""
    from hetmoe.kernels import pair_config as pc

    tables = [t for t in (pc.PAIR_CONFIGS, pc.ONE_TOKEN_PAIR_CONFIGS) if fmt in t]
    shipped = [t[fmt] for t in tables]
    for table in tables:
        table[fmt] = shape or table[fmt]
    try:
        yield dataclasses.astuple(pc.pair_config_for(fmt, 1))
    finally:
        for table, cfg in zip(tables, shipped, strict=True):
            table[fmt] = cfg


def decoded(runner: ModelRunner, prompt: list[int], tokens: list[int]) -> Decoded:
    """A greedy run's `tokens` after `prompt` with the logits each step chose from, teacher-
    forced in one prefill of a fresh slot under the current placement (graph_device_row's
    `Decoded`: step i's [1, V] logits chose token i + 1; tokens[0] is the prefill's)."""
    slot = runner.cache.allocate()
    try:
        logits = runner.prefill_logits(slot, prompt + tokens[:-1])[len(prompt):]
    finally:
        runner.cache.free(slot)
    return [tokens], [row[None].float().cpu() for row in logits]


def decode_rows(runner: ModelRunner, plan: Any, args: argparse.Namespace, prompt: list[int],
                base: list[Decoded], shapes: list[Any]) -> list[dict[str, Any]]:
    """Greedy decode under the current placement, per (deferred, defer order,
    placement_interval, decode kernels, pair kernel shape: PAIR_CONFIGS' then `shapes`); d=0
    once, whatever the orders (it defers nothing). The first run is the reference (`base`, its
    logits kept); a run whose tokens part from it records where, with the reference's top-2
    logit gap there (`budget0_diverged`: a near-tie flips on rounding, a fault on a clear
    winner)."""
    rows = []
    kernels = [k for k in args.decode_kernels.split(",") if k] or [None]
    orders = args.defer_orders.split(",")
    settings = [(int(d), o, int(n), k, shape) for d in args.deferred.split(",")
                for o in (orders if int(d) else orders[:1])
                for n in args.intervals.split(",") for k in kernels
                for shape in [None, *shapes]]
    for d, order, interval, kernel, shape in settings:
        if kernel is not None and runner.fused is not None:
            runner.fused.kernels = kernel  # the layer functions are keyed by it: no recompile
        runner.reset_graphs(d, order)
        runner.policy = None
        for slots in runner.placement.layers if runner.placement is not None else []:
            slots.counting = False  # a policy below turns it on again
        if interval and runner.placement is not None and not plan.everything:
            runner.policy = TrafficPolicy(runner.placement, interval)
        with pair_config(args.weight_format, shape) as fields:
            run = measure.greedy_decode(runner, prompt, args.new_tokens)
        if not base:
            base.append(decoded(runner, prompt, run.tokens))
        same = next((i for i, (a, b) in enumerate(zip(run.tokens, base[0][0][0], strict=True))
                     if a != b), len(run.tokens))
        rows.append({"deferred": d, "defer_order": order, "placement_interval": interval,
                     "decode_kernels": runner.fused.kernels if runner.fused else None,
                     "dependent_launch": bool(runner.fused and runner.fused.dependent),
                     "pair_config": list(fields), "pair_config_shipped": shape is None,
                     "moves": runner.policy.moves if runner.policy is not None else 0,
                     "tok_s": round(run.tok_s, 2), "mean_tok_s": round(run.mean_tok_s, 2),
                     "tokens_equal_budget0_first": same})
        if same < len(run.tokens):
            rows[-1]["budget0_diverged"] = diverged(decoded(runner, prompt, run.tokens), base[0])
        print(f"  decode d={d} ({order}) interval {interval} kernels "
              f"{rows[-1]['decode_kernels']} pairs {fields}: "
              f"{run.tok_s:7.2f} tok/s, "
              f"{rows[-1]['moves']} moves, tokens equal to the first run's for "
              f"{same}/{len(run.tokens)}"
              + (f" ({rows[-1]['budget0_diverged']})" if same < len(run.tokens) else ""),
              flush=True)
    if shapes:
        runner.reset_graphs()  # the graphs after this (profile, prefill) capture the shipped
    return rows


def pair_shapes(texts: list[str], parser: argparse.ArgumentParser) -> list[Any]:
    """`--pair-shapes` as `PairConfig`s, checked before the minutes of building the model."""
    if not texts:
        return []
    from hetmoe.kernels.pair_config import parse_pair_config

    try:
        return [parse_pair_config(t) for t in texts]
    except ValueError as e:
        parser.error(f"--pair-shapes: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before the minutes of building the model; `command` is the
    line that reruns it, `budget_list`, `shapes`, `lengths` and `modes` the parsed values."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--weight-format", default="int8")
    p.add_argument("--budgets", default="0,8,15,23,all", help="GB per row, or all")
    p.add_argument("--deferred", default="0", help="Expert Deferral values per budget")
    p.add_argument("--defer-orders", default=EngineConfig.defer_order,
                   help="deferral orders per d > 0: misses (the engine's default), score or "
                        "both (score,misses)")
    p.add_argument("--intervals", default="0",
                   help="placement_interval values per budget (0: static placement)")
    p.add_argument("--prefill", default="",
                   help="prompt lengths whose prefill is timed per budget, e.g. 4096,16384")
    p.add_argument("--prefill-modes", default="auto,cpu",
                   help="prefill_experts modes timed per length (auto: the engine's pick; cpu: "
                        "resident experts on the GPU, the misses on the CPU)")
    p.add_argument("--prefill-repeats", type=int, default=2, help="best of this many passes")
    p.add_argument("--decode-kernels", default="",
                   help="fused decode step's GQA kernels per budget, e.g. torch,triton (an A/B "
                        "in one process; default: HETMOE_DECODE_KERNELS)")
    p.add_argument("--pair-shapes", nargs="*", default=[], metavar="FIELDS",
                   help="decode rows also with these pair kernel launch shapes for the run's "
                        "format (PairConfig fields comma-separated, flags 0/1, e.g. "
                        "32,1,64,1,4,2,4,1,1), after PAIR_CONFIGS' own: an A/B in one process")
    p.add_argument("--profile", action="store_true",
                   help="GPU kernels of 16 graph steps at the last budget (torch.profiler)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="with --json of an earlier run: only draw its PNG (no GPU needed)")
    args = p.parse_args(argv)
    args.command = command_line(vars(args))
    try:
        args.budget_list = parse_budgets(args.budgets)
    except ValueError as e:
        p.error(str(e))
    unknown = {k for k in args.decode_kernels.split(",") if k} - {"triton", "torch"}
    if unknown:  # the A/B sets the decoder's choice directly, past its own check
        p.error(f"--decode-kernels: triton or torch, got {', '.join(sorted(unknown))}")
    bad = set(args.defer_orders.split(",")) - set(DEFER_ORDERS)
    if bad:
        p.error(f"--defer-orders: {' or '.join(DEFER_ORDERS)}, got {', '.join(sorted(bad))}")
    args.shapes = pair_shapes(args.pair_shapes, p)
    args.lengths = [int(n) for n in args.prefill.split(",") if n]
    args.modes = [m for m in args.prefill_modes.split(",") if m]
    return args


def command_line(options: dict[str, Any]) -> str:
    """The command that reruns a run of these `options` (argparse's values by dest): flags
    bare, `--pair-shapes` spaced, unset options left out."""
    words = ["benchmarks/engine/bench_gpu_experts.py"]
    for name, value in options.items():
        if value is None or value is False or value in ("", []):
            continue
        words.append(f"--{name.replace('_', '-')}")
        if value is not True:
            words += map(str, value) if isinstance(value, list) else [str(value)]
    return " ".join(words)


def main() -> None:
    args = parse_args()
    if args.plot:
        with open(args.json) as f:
            plot(json.load(f), args.plot)
        return
    budgets, shapes, lengths = args.budget_list, args.shapes, args.lengths
    device = torch.device("cuda")
    host_gb_s = measure.read_bandwidth(2.0)
    hbm = hbm_read_gb_s(device)
    config = shape_config(args.shape, args.num_layers)
    start = time.perf_counter()
    model = build_random_model(config, device, torch.bfloat16, "cpu", args.weight_format, 0)
    build_s = time.perf_counter() - start
    routed = measure.routed_bytes_per_token(model)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    window = max([args.prompt_len + args.new_tokens, *lengths]) + 8
    runner = ModelRunner(model, device, torch.bfloat16, 1, window,
                         EngineConfig(gpu_expert_bytes=0))  # placed per budget below
    assert runner.overlap is not None
    moe = runner.overlap.cpu[0]
    result: dict[str, Any] = {
        "command": args.command,
        "date": now_utc(), "git": git_sha(), "machine": machine_facts(device), "shape": args.shape,
        "weight_format": args.weight_format, "group_size": moe.group_size,
        "moe_layers": len(runner.overlap.cpu),
        "host_read_gb_s": round(host_gb_s, 1), "hbm_read_gb_s": round(hbm, 1),
        "build_s": round(build_s, 1), "routed_bytes_per_token": routed,
        "gpu_compute": ("triton packed_moe" if use_kernel(device, args.weight_format)
                        else "torch (unpack + bmm)"),
        "rows": [], "prefill": [],
    }
    print(f"host {host_gb_s:.1f} GB/s, HBM {hbm:.0f} GB/s, built in {build_s:.1f} s, "
          f"{routed / 1e6:.1f} MB of routed experts per token, GPU compute: "
          f"{result['gpu_compute']}", flush=True)
    base: list[Decoded] = []
    for budget in budgets:
        limit = budget_bytes(budget)
        plan = runner.place(10**15 if limit is None else limit)  # all: more than there is
        share = plan.gpu_share()
        gpu_bytes, cpu_bytes = routed * share, routed * (1 - share)
        floor = 1 / max(cpu_bytes / (host_gb_s * GB), gpu_bytes / (hbm * GB), 1e-9)
        facts = {"budget": budget, "gpu_expert_bytes": plan.bytes,
                 "experts_per_layer": [len(r) for r in plan.resident][:1] + [
                     min(len(r) for r in plan.resident)],
                 "gpu_share": round(share, 4), "cpu_bytes_per_token": int(cpu_bytes),
                 "floor_tok_s": round(floor, 1),
                 "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / GB, 2)}
        print(f"budget {budget:>4} GB: {plan.bytes / GB:6.2f} GB resident ({share:.1%} of "
              f"routed work), floor {floor:7.1f} tok/s", flush=True)
        for row in decode_rows(runner, plan, args, prompt, base, shapes):
            row["of_floor"] = round(row["tok_s"] / floor, 3)
            result["rows"].append({**facts, **row})
        for row in prefill_rows(runner, lengths, args.modes, args.prefill_repeats,
                                config.vocab_size, plan.everything):
            result["prefill"].append({"budget": budget, "gpu_expert_bytes": plan.bytes, **row})
        write(result, args.json)
    if args.profile:
        result["profile"] = profile_steps(runner, prompt)
    write(result, args.json)


if __name__ == "__main__":
    main()
