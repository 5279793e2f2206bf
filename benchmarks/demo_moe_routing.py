"""Routing statistics of a model's MoE layers on a text: what GPU expert placement can gain.

Per layer, over every (token, slot) pick of the router on the windows, in token order:
- share of picks on the hottest 10 % / 25 % of the experts (uniform routing: 10 % / 25 %);
- Gini coefficient of the experts' pick counts (0 = uniform);
- hit rate of an LRU and an LFU cache of c experts per layer, token by token, updated between
  tokens (uniform routing: c / E).
Used by benchmarks/demo_moe_quality.py.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from hetmoe.ops.moe import moe_layers

if TYPE_CHECKING:
    from hetmoe import LLM
    from hetmoe.engine.runner import ModelRunner

CACHE_SHARES = (0.25, 0.5, 0.75)
"""Cache sizes as shares of a layer's experts."""


@torch.inference_mode()
def record_picks(llm: LLM, runner: ModelRunner, windows: list[list[int]]) -> list[torch.Tensor]:
    """Expert ids [N, K] each MoE layer's router picks over the windows (prefill, exact)."""
    layers = moe_layers(llm.model)
    picks: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [moe.gate.register_forward_hook(
        lambda _m, _a, out, i=i: picks[i].append(out[0].reshape(-1, out[0].shape[-1])))
        for i, moe in enumerate(layers)]
    try:
        for ids in windows:
            runner.lengths[0] = 0
            runner.prefill(0, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(p) for p in picks]


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
