"""Hit rate of GPU expert placement on learned routing (`demo-moe`), against the budget share.

Issue 27 asks how much of the routed work resident experts take where routing is learned, not
uniform. On the CPU (no GPU needed: the engine's placement classes run on any device, so the
"GPU" slots here are host tensors) this records each MoE layer's router picks over held-out text
(prefill, exact), then replays them token by token through the engine's own `LayerSlots.split`
(the slot table lookup a decode step does) and, between tokens, `TrafficPolicy.after_step`, and
counts the (token, expert) pairs that found their expert resident. Placements per budget share
(budget = share x every routed expert's packed bytes, `ModelRunner.place`):
- static: the plan without routing counts (the first experts of each layer);
- profile: the plan ranked by counts from the build's training documents (a stored profile);
- traffic: static, then `TrafficPolicy` every `--interval` tokens (moves follow the counts);
- profile + traffic: the profile's plan, then the policy;
- hindsight: the plan ranked by the held-out text's own counts (the best static placement; a
  ceiling, not a policy).
Uniform routing would hit the budget share.

Usage: python benchmarks/demo_moe/placement.py [--windows 6] [--train-windows 24]
                                               [--shares 0.125,0.25,0.5,0.75] [--interval 16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from demo_moe_eval import held_out_windows, record_picks, stamp, stamp_line, write_marked

from hetmoe import LLM
from hetmoe.config import EngineConfig
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.engine.placement.placement_policy import TrafficPolicy
from hetmoe.presets import resolve_model
from hetmoe.presets.demo_moe_corpus import token_windows, train_texts

SCRIPT = "benchmarks/demo_moe/placement.py"

POLICIES = ("static", "profile", "traffic", "profile + traffic", "hindsight")


def replay(runner: ModelRunner, picks: list[torch.Tensor], interval: int) -> tuple[float, int]:
    """Share of picks [N, K] per layer that find their expert resident, token by token, with a
    `TrafficPolicy` stepping between tokens when `interval` > 0; and the experts it moved."""
    placement = runner.placement
    assert placement is not None
    policy = TrafficPolicy(placement, interval) if interval else None
    hits = total = 0
    for t in range(picks[0].shape[0]):
        for slots, ids in zip(placement.layers, picks, strict=True):
            slot, _ = slots.split(ids[t:t + 1])  # [1, K]: the table lookup of a decode step
            hits += int((slot >= 0).sum())
            total += slot.numel()
        if policy is not None:
            policy.after_step()
    return hits / total, policy.moves if policy is not None else 0


def hit_rates(runner: ModelRunner, train: list[torch.Tensor], test: list[torch.Tensor],
              shares: list[float], interval: int, num_experts: int) -> list[dict[str, Any]]:
    """One row per budget share: each placement's hit rate (see the module docstring)."""
    profile = [torch.bincount(p.flatten(), minlength=num_experts) for p in train]
    hindsight = [torch.bincount(p.flatten(), minlength=num_experts) for p in test]
    total = runner.place(10**15).total_bytes  # every expert: the share's denominator
    rows = []
    for share in shares:
        row: dict[str, Any] = {"share": share}
        for name in POLICIES:
            counts = {"profile": profile, "profile + traffic": profile,
                      "hindsight": hindsight}.get(name)
            plan = runner.place(int(share * total), counts)
            row["experts_per_layer"] = sorted({len(r) for r in plan.resident})
            row["budget_share"] = plan.bytes / plan.total_bytes
            hit, moves = replay(runner, test, interval if "traffic" in name else 0)
            row[name] = hit
            if "traffic" in name:
                row[f"{name} moves"] = moves
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.place(0)
    return rows


def table(rows: list[dict[str, Any]], interval: int) -> str:
    head = ["budget share (experts per layer)", *(
        f"{p} (every {interval} tokens)" if "traffic" in p else p for p in POLICIES),
        "moves (traffic / profile + traffic)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        per_layer = "-".join(str(n) for n in r["experts_per_layer"])
        lines.append("| " + " | ".join([
            f"{r['budget_share']:.1%} ({per_layer})", *(f"{r[p]:.1%}" for p in POLICIES),
            f"{r['traffic moves']} / {r['profile + traffic moves']}"]) + " |")
    return "\n".join(lines)


def write_doc(doc: Path, text: str) -> None:
    """Replaces the text between the doc's hit-rate markers (the prose around them is kept)."""
    write_marked(doc, "hit rate", SCRIPT, text)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-windows", type=int, default=24, help="profile windows")
    parser.add_argument("--windows", type=int, default=6, help="held-out windows replayed")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--shares", default="0.125,0.25,0.5,0.75")
    parser.add_argument("--interval", type=int, default=16, help="TrafficPolicy interval")
    parser.add_argument("--doc", default="docs/benchmarks/gpu_experts.md",
                        help="report whose hit-rate markers get the table ('': none)")
    args = parser.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]
    llm = LLM(resolve_model("demo-moe"), device="cpu", dtype="float32", experts="cpu",
              progress=False, max_seq_len=args.window, gpu_expert_bytes=0)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, args.window,
                         EngineConfig(gpu_expert_bytes=0))

    start = time.perf_counter()
    train_windows = token_windows([llm.encode(t) for t in train_texts()], args.window,
                                  args.train_windows)
    train = record_picks(llm, runner, train_windows)
    test = record_picks(llm, runner, held_out_windows(llm.encode, args.window, args.windows))
    num_experts = int(llm.model.config.num_local_experts)
    print(f"recorded {train[0].shape[0]} profile / {test[0].shape[0]} held-out tokens in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    rows = hit_rates(runner, train, test, shares, args.interval, num_experts)
    line = stamp_line(stamp(__file__, argv), (
        f"{test[0].shape[0]} held-out tokens x {len(test)} MoE layers, top-{test[0].shape[1]} of "
        f"{num_experts}; profile from {train[0].shape[0]} training tokens"))
    text = f"{line}\n\n{table(rows, args.interval)}"
    print(text)
    if args.doc:
        write_doc(Path(args.doc), text)
    return rows


if __name__ == "__main__":
    main()
