"""Routing statistics of a model's MoE layers on a text: what GPU expert placement can gain.

Per layer, over every (token, slot) pick of the router on the windows, in token order:
- share of picks on the hottest 10 % / 25 % of the experts (uniform routing: 10 % / 25 %);
- Gini coefficient of the experts' pick counts (0 = uniform);
- hit rate of an LRU and an LFU cache of c experts per layer, token by token, updated between
  tokens (uniform routing: c / E).
Used by quality.py.

Run alone, it answers SMoE's prefetch question on `demo-moe`: a gate-shaped model (linear, or an
MLP with --hidden N) trained on the build's training documents predicts layer i+1's experts from
layer i's MoE input (or output, --source output); hit rates on the held-out text against reusing
layer i's own picks, the most-frequent (LFU) experts and layer i+1's router applied to layer i's
input (pre-gating); writes the JSON's "predictor" field and the doc's predictor table.

Usage: python benchmarks/demo_moe/routing.py [--train-windows 24] [--windows 6] [--window 256]
                                             [--hidden 0] [--steps 300] [--source input]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from demo_moe_eval import (
    held_out_windows,
    prefill_with,
    record_picks,
    stamp,
    stamp_line,
    write_marked,
)

from hetmoe import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.moe import moe_layers
from hetmoe.presets import resolve_model
from hetmoe.presets.demo_moe_corpus import token_windows, train_texts

SCRIPT = "benchmarks/demo_moe/routing.py"

CACHE_SHARES = (0.25, 0.5, 0.75)
"""Cache sizes as shares of a layer's experts."""


def gini(counts: torch.Tensor) -> float:
    """Gini coefficient of non-negative counts (0 = all equal, ->1 = one takes all)."""
    x = counts.double().sort().values
    n = x.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return float(((2 * ranks - n - 1) * x).sum() / (n * x.sum()))


def cache_hits(ids: torch.Tensor, size: int, policy: str) -> float:
    """Hit rate of a `policy` ("lru" / "lfu") cache of `size` experts over picks ids [N, K]:
    each token's picks are looked up in the cache as the previous token left it, then the
    cache takes them in (placement changes between steps, never within one)."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    uses: dict[int, int] = {}
    hits = total = 0
    for row in ids.tolist():
        hits += sum(e in cache for e in row)
        total += len(row)
        for e in row:
            uses[e] = uses.get(e, 0) + 1
            if e in cache:
                cache.move_to_end(e)
                continue
            if len(cache) >= size:
                victim = (next(iter(cache)) if policy == "lru"
                          else min(cache, key=lambda c: uses[c]))
                if policy == "lfu" and uses[victim] >= uses[e]:
                    continue  # LFU keeps its more used experts
                del cache[victim]
            cache[e] = None
    return hits / total


def layer_stats(ids: torch.Tensor, num_experts: int) -> dict[str, Any]:
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    hot = counts.sort(descending=True).values.double() / counts.sum()
    stats: dict[str, Any] = {
        "top10": float(hot[: math.ceil(0.10 * num_experts)].sum()),
        "top25": float(hot[: math.ceil(0.25 * num_experts)].sum()),
        "gini": gini(counts),
    }
    for share in CACHE_SHARES:
        size = max(1, round(share * num_experts))
        stats[f"lru@{size}"] = cache_hits(ids, size, "lru")
        stats[f"lfu@{size}"] = cache_hits(ids, size, "lfu")
    return stats


def routing_stats(llm: LLM, runner: ModelRunner, windows: list[list[int]]) -> dict[str, Any]:
    """Per-layer statistics (and their mean) of the model's routing on `windows`."""
    num_experts = int(llm.model.config.num_local_experts)
    layers = [layer_stats(ids, num_experts) for ids in record_picks(llm, runner, windows)]
    mean = {k: sum(s[k] for s in layers) / len(layers) for k in layers[0]}
    return {"num_experts": num_experts, "layers": layers, "mean": mean}


def routing_table(routing: dict[str, Any]) -> str:
    """Markdown: one row per layer and the mean, with the uniform-routing value of each column."""
    e = routing["num_experts"]
    keys = list(routing["mean"])
    uniform = {"top10": math.ceil(0.10 * e) / e, "top25": math.ceil(0.25 * e) / e, "gini": 0.0}
    for key in keys:
        if "@" in key:
            uniform[key] = int(key.split("@")[1]) / e
    head = ["layer", *(k.replace("top", "top ") + (" %" if k.startswith("top") else "")
                       for k in keys)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]

    def row(name: str, stats: dict[str, float]) -> str:
        return "| " + " | ".join([name, *(f"{stats[k]:.2f}" for k in keys)]) + " |"

    lines += [row(str(i), s) for i, s in enumerate(routing["layers"])]
    lines += [row("**mean**", routing["mean"]), row("uniform routing", uniform)]
    return "\n".join(lines)


@torch.inference_mode()
def record_states(llm: LLM, runner: ModelRunner, windows: list[list[int]],
                  source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per MoE layer over the windows: the predictor's input [L, N, H] (the block's input or
    output), the router's input [L, N, H] and its picks [L, N, K]."""
    layers = moe_layers(llm.model)
    xs: list[list[torch.Tensor]] = [[] for _ in layers]
    outs: list[list[torch.Tensor]] = [[] for _ in layers]
    picks: list[list[torch.Tensor]] = [[] for _ in layers]

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, t.shape[-1]).float()

    def on_gate(i: int, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]) -> None:
        xs[i].append(flat(args[0]))
        picks[i].append(flat(out[0]).long())

    hooks = [moe.gate.register_forward_hook(lambda _m, a, out, i=i: on_gate(i, a, out))
             for i, moe in enumerate(layers)]
    if source == "output":  # the block's output (its input is the router's, recorded above)
        hooks += [moe.register_forward_hook(lambda _m, _a, out, i=i: outs[i].append(flat(out)))
                  for i, moe in enumerate(layers)]
    prefill_with(runner, windows, hooks)
    x = torch.stack([torch.cat(t) for t in xs])
    feats = x if source == "input" else torch.stack([torch.cat(t) for t in outs])
    return feats, x, torch.stack([torch.cat(t) for t in picks])


def train_predictors(feats: torch.Tensor, targets: torch.Tensor, hidden: int,
                     steps: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gate-shaped predictors for all layer pairs at once: feats [P, N, H] of layer i, targets
    [P, N, E] multi-hot picks of layer i+1; BCE, full-batch Adam. Returns feats -> scores."""
    mean, std = feats.mean(1, keepdim=True), feats.std(1, keepdim=True) + 1e-5
    p, _, h = feats.shape
    e = targets.shape[-1]
    gen = torch.Generator().manual_seed(0)
    dims = [h, hidden, e] if hidden else [h, e]
    params = []
    for a, b in zip(dims[:-1], dims[1:], strict=True):
        params += [(torch.randn(p, a, b, generator=gen) / math.sqrt(a)).requires_grad_(),
                   torch.zeros(p, 1, b, requires_grad=True)]

    def predict(f: torch.Tensor) -> torch.Tensor:
        z = (f - mean) / std  # [P, N, H]
        for j in range(0, len(params), 2):
            z = torch.baddbmm(params[j + 1], z, params[j])
            if j + 2 < len(params):
                z = F.gelu(z)
        return z  # [P, N, E]

    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(predict(feats), targets).backward()
        opt.step()
    return predict


def hit_rate(scores: torch.Tensor, actual: torch.Tensor, m: int) -> torch.Tensor:
    """Per layer pair: share of the actual picks actual [P, N, K] found in the top-m of scores
    [P, N, E] (or [P, 1, E]: one guess for every token)."""
    guess = torch.zeros(scores.shape).scatter_(-1, scores.topk(m, dim=-1).indices, 1.0)
    guess = guess.expand(*actual.shape[:2], -1)
    return guess.gather(-1, actual).mean((1, 2))


def multi_hot(picks: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(*picks.shape[:-1], num_experts).scatter_(-1, picks, 1.0)


def predictor_stats(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Trains on the build's training documents, measures on the held-out ones."""
    llm = LLM(resolve_model("demo-moe"), device="cpu", dtype="float32", experts="torch",
              progress=False, max_seq_len=args.window)
    runner = ModelRunner(llm.model, llm.device, llm.dtype, 1, args.window)
    num_experts = int(llm.model.config.num_local_experts)
    top_k = moe_layers(llm.model)[0].gate.config.top_k
    gates = torch.stack([m.gate.weight.float() for m in moe_layers(llm.model)])  # [L, E, H]

    train_windows = token_windows([llm.encode(t) for t in train_texts()], args.window,
                                  args.train_windows)
    train = record_states(llm, runner, train_windows, args.source)
    test = record_states(llm, runner, held_out_windows(llm.encode, args.window, args.windows),
                         args.source)
    log(f"recorded {train[0].shape[1]} training / {test[0].shape[1]} held-out tokens")
    start = time.perf_counter()
    predict = train_predictors(train[0][:-1], multi_hot(train[2][1:], num_experts), args.hidden,
                               args.steps)
    log(f"trained {len(gates) - 1} predictors in {time.perf_counter() - start:.0f} s")
    feats, x, picks = test
    nxt = picks[1:]
    freq = multi_hot(train[2][1:], num_experts).sum(1, keepdim=True)  # [P, 1, E]
    with torch.no_grad():
        guesses = {"predictor": predict(feats[:-1]),
                   "reuse": torch.bmm(x[:-1], gates[:-1].transpose(1, 2)),  # layer i's router
                   "next_router": torch.bmm(x[:-1], gates[1:].transpose(1, 2)),
                   "lfu": freq}
    ms = (top_k, min(top_k + 2, num_experts))
    per = {f"{g}@{m}": hit_rate(s, nxt, m) for g, s in guesses.items() for m in ms}
    layers = [{k: float(v[i]) for k, v in per.items()} for i in range(len(gates) - 1)]
    return {"num_experts": num_experts, "top_k": top_k, "source": args.source,
            "hidden": args.hidden, "steps": args.steps, "train_tokens": int(train[0].shape[1]),
            "held_out_tokens": int(feats.shape[1]), "layers": layers,
            "mean": {k: float(v.mean()) for k, v in per.items()},
            "uniform": {f"uniform@{m}": m / num_experts for m in ms}}


def predictor_table(pred: dict[str, Any]) -> str:
    """Markdown: one row per layer pair (i -> i+1), the mean, and random guessing."""
    keys = list(pred["mean"])
    lines = ["| layer i -> i+1 | " + " | ".join(k.replace("_", " ") for k in keys) + " |",
             "|" + "---:|" * (len(keys) + 1)]
    rows = [(f"{i} -> {i + 1}", s) for i, s in enumerate(pred["layers"])]
    rows.append(("**mean**", pred["mean"]))
    for name, stats in rows:
        lines.append("| " + " | ".join([name, *(f"{stats[k]:.3f}" for k in keys)]) + " |")
    uniform = [f"{pred['uniform']['uniform@' + k.split('@')[1]]:.3f}" for k in keys]
    lines.append("| random guess | " + " | ".join(uniform) + " |")
    return "\n".join(lines)


def write_doc(doc: Path, table: str, header: str) -> None:
    """Replaces the text between the doc's predictor markers (the prose around them is kept)."""
    write_marked(doc, "predictor", SCRIPT, f"{header}\n\n{table}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="next-layer expert predictor on demo-moe")
    parser.add_argument("--train-windows", type=int, default=24, help="training windows")
    parser.add_argument("--windows", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--hidden", type=int, default=0, help="MLP hidden size (0: linear)")
    parser.add_argument("--steps", type=int, default=300, help="full-batch Adam steps")
    parser.add_argument("--source", choices=("input", "output"), default="input",
                        help="layer i's MoE block input or output feeds the predictor")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    pred = predictor_stats(args, lambda line: print(line, flush=True))
    pred.update(stamp(__file__, argv))
    table = predictor_table(pred)
    print(table)
    path = args.out / "demo_moe.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result["predictor"] = pred
    path.write_text(json.dumps(result, indent=1) + "\n")
    write_doc(args.out / "demo_moe.md", table, stamp_line(
        pred, f"{pred['train_tokens']} training / {pred['held_out_tokens']} held-out tokens"))
    return pred


if __name__ == "__main__":
    main()
