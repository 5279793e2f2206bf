"""llama.cpp beside hetmoe under one GPU expert budget (benchmarks/engine/gpu_experts_sweep.py).

llama.cpp's `-ncmoe N` keeps the routed experts of the first N layers in host memory and puts
every other layer's on the GPU, so its budgets come in whole layers. For each budget (GB, 1e9
bytes, or `all`) the sweep takes the N whose GPU layers' expert bytes fit it: the most GPU
layers with layers x layer bytes <= budget. Bytes are Q8_0's (34 bytes per 32 weights: an fp16
scale per 32 int8 values), the format llama.cpp reads where hetmoe reads INT8. This module
makes the llama-bench command lines and reads their JSONL rows back; nothing here runs them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetmoe.bench.shapes import routed_expert_shape, shape_config

GB = 10**9

Q8_0_BYTES_PER_WEIGHT = 34 / 32
"""Q8_0 block: an fp16 scale and 32 int8 weights."""

ROW_FIELDS = ("n_cpu_moe", "n_prompt", "n_gen", "n_batch", "n_ubatch", "n_threads", "avg_ts",
              "stddev_ts", "samples_ts")
"""The llama-bench JSONL fields kept per row."""


def parse_budgets(text: str) -> list[str]:
    """"0,8,15,23,all" -> ["0", "8", "15", "23", "all"]: GB >= 0 or `all`, in the given order."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise ValueError(f"--budgets needs at least one of GB >= 0 or all, got {text!r}")
    for b in budgets:
        if b == "all":
            continue
        try:
            ok = float(b) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--budgets takes GB >= 0 or all, got {b!r} in {text!r}")
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"--budgets lists a budget twice: {text!r}")
    return budgets


def budget_bytes(budget: str) -> int | None:
    """A budget's bytes (GB = 1e9 bytes); None for `all`."""
    return None if budget == "all" else int(float(budget) * GB)


def q8_0_layer_bytes(shape: str) -> int:
    """Bytes of one MoE layer's routed experts in Q8_0 (gate, up and down of every expert)."""
    experts, hidden, intermediate, _ = routed_expert_shape(shape)
    return int(3 * experts * hidden * intermediate * Q8_0_BYTES_PER_WEIGHT)


def moe_layer_count(shape: str) -> int:
    """MoE layers of `shape` (layers past DeepSeek's dense first ones)."""
    config = shape_config(shape)
    return int(config.num_hidden_layers) - int(getattr(config, "first_k_dense_replace", 0) or 0)


@dataclass(frozen=True)
class PeerBudget:
    """llama.cpp's setting for one budget."""

    budget: str
    """The budget as given (GB or `all`)."""
    ncmoe: int
    """`-ncmoe`: layers whose routed experts stay in host memory."""
    gpu_layers: int
    """Layers whose routed experts are on the GPU."""
    gpu_expert_bytes: int
    """Q8_0 bytes of the experts on the GPU."""


def ncmoe_for(budget: str, layer_bytes: int, layers: int) -> PeerBudget:
    """The `-ncmoe` of `budget`: as many GPU layers as fit it (see the module docstring)."""
    if layer_bytes <= 0 or layers <= 0:
        raise ValueError(f"ncmoe_for: layer bytes and layers must be positive, got "
                         f"{layer_bytes}, {layers}")
    limit = budget_bytes(budget)
    gpu = layers if limit is None else min(layers, limit // layer_bytes)
    return PeerBudget(budget, layers - gpu, gpu, gpu * layer_bytes)


def peer_budgets(budgets: Sequence[str], shape: str) -> list[PeerBudget]:
    """Each budget's `-ncmoe` for `shape` in Q8_0."""
    return [ncmoe_for(b, q8_0_layer_bytes(shape), moe_layer_count(shape)) for b in budgets]


def bench_args(gguf: str, ncmoe: Sequence[int], threads: int, prompt: int, gen: int,
               ubatches: Sequence[int], reps: int) -> list[str]:
    """llama-bench arguments of one call: every layer on the GPU (`-ngl 99`) but the experts of
    the first N (`-ncmoe`, one model load per N), pp`prompt` at each ubatch (batch = the largest)
    and tg`gen` (0: none), `reps` repetitions, weights in pinned host memory (`-lm none`, the
    peer kit's setting), JSONL rows on stdout."""
    if not ncmoe or not ubatches or reps < 1 or threads < 1:
        raise ValueError(f"bench_args: needs -ncmoe values, ubatches, reps >= 1 and threads >= 1, "
                         f"got {list(ncmoe)}, {list(ubatches)}, {reps}, {threads}")
    join = ",".join
    return ["-m", gguf, "-ngl", "99", "-ncmoe", join(str(n) for n in ncmoe), "-t", str(threads),
            "-p", str(prompt), "-n", str(gen), "-b", str(max(ubatches)),
            "-ub", join(str(u) for u in ubatches), "-r", str(reps), "-lm", "none",
            "-o", "jsonl"]


def parse_rows(text: str) -> list[dict[str, Any]]:
    """llama-bench JSONL (one test per line; other lines ignored) -> rows of `ROW_FIELDS`."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        raw = json.loads(line)
        missing = [f for f in ROW_FIELDS if f not in raw]
        if missing:
            raise ValueError(f"llama-bench row lacks {', '.join(missing)}: {line[:200]}")
        rows.append({f: raw[f] for f in ROW_FIELDS})
    return rows


def by_budget(peers: Sequence[PeerBudget], rows: Sequence[dict[str, Any]],
              prompts: Sequence[int] = (4096, 16384), gen: int = 128) -> dict[str, Any]:
    """Per budget: tg`gen` tok/s and, per prompt length, the best ubatch's pp tok/s (and that
    ubatch; every ubatch's in `pp_by_ubatch`). Budgets whose rows are missing (a run cut by its
    deadline) get None."""
    out: dict[str, Any] = {}
    for peer in peers:
        mine = [r for r in rows if r["n_cpu_moe"] == peer.ncmoe]
        tg = [r["avg_ts"] for r in mine if r["n_gen"] == gen and r["n_prompt"] == 0]
        entry: dict[str, Any] = {"ncmoe": peer.ncmoe, "gpu_layers": peer.gpu_layers,
                                 "gpu_expert_bytes": peer.gpu_expert_bytes,
                                 f"tg{gen}": max(tg) if tg else None}
        for n in prompts:
            pp = {r["n_ubatch"]: r["avg_ts"] for r in mine if r["n_prompt"] == n
                  and r["n_gen"] == 0}
            best = max(pp, key=lambda u: pp[u]) if pp else None
            entry[f"pp{n}"] = pp[best] if best is not None else None
            entry[f"pp{n}_ubatch"] = best
            entry[f"pp{n}_by_ubatch"] = {str(u): t for u, t in sorted(pp.items())}
        out[peer.budget] = entry
    return out
