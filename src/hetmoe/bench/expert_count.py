"""Distinct routed experts per ubatch, and what a copy of only those experts costs.

llama.cpp with its experts in host memory (`-ot exps=CPU`) prefills 32+ tokens on the GPU and,
per ubatch, copies only the experts that ubatch's router picked (ggml-backend.cpp's scheduler
reads the MUL_MAT_ID ids and copies each run of used experts). Its prefill speed is then bounded
by the DISTINCT experts per ubatch, not by every expert: concentrated routing makes it look fast.

llama-bench's prompt (tools/llama-bench/llama-bench.cpp, `test_prompt`): token ids
`std::rand() % n_vocab`, uniform over the whole vocabulary (the first one BOS when the vocab
adds one; Qwen2's does not), fed `n_batch` (2048) at a time and cut into ubatches of 512. The
ids here are `torch.randint(0, vocab)`: the same distribution.

`count_row` prefills one random prompt while every router's calls are recorded
(ops/routing_record.py), counts the distinct expert ids per MoE layer per ubatch, and prices a
used-experts-only copy with per-expert bytes (ours packed, or the GGUF's quant blocks) against a
host-to-device bandwidth.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hetmoe.engine.executor.overlap import cpu_moe_of
from hetmoe.loading.gguf import open_gguf
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.routing_record import record_routing

if TYPE_CHECKING:
    from hetmoe.engine.executor.runner import ModelRunner

UBATCH = 512
"""llama.cpp's default ubatch (tokens per graph evaluation, per expert copy)."""


def routed_picks(runner: ModelRunner, ids: list[int]) -> list[torch.Tensor]:
    """Expert ids [T, K] (int64, host) per MoE layer of one prefill of `ids` in a fresh slot;
    the router's calls of a layer joined in call order (token order: chunks run in turn)."""
    with record_routing(runner.model) as routing:
        if not routing.layers:
            raise ValueError("counting experts needs a model with hybrid_moe layers")
        slot = runner.cache.allocate()
        try:
            runner.prefill(slot, ids)
        finally:
            runner.free(slot)
    out = [picks.to("cpu", torch.int64) for picks in routing.picks()]
    for i, picks in enumerate(out):
        if picks.shape[0] != len(ids):
            raise RuntimeError(f"MoE layer {i}: the router saw {picks.shape[0]} tokens for a "
                               f"{len(ids)}-token prompt (a call the hook missed or doubled)")
    return out


def distinct_per_ubatch(picks: torch.Tensor, ubatch: int = UBATCH) -> list[int]:
    """Distinct expert ids in each run of `ubatch` tokens of `picks` [T, K] (ids < 0 are no
    expert); the last run may be shorter."""
    if ubatch < 1:
        raise ValueError(f"ubatch must be >= 1 token, got {ubatch}")
    counts = []
    for start in range(0, picks.shape[0], ubatch):
        chunk = picks[start:start + ubatch].reshape(-1)
        counts.append(int(chunk[chunk >= 0].unique().numel()))
    return counts


def packed_expert_bytes(model: torch.nn.Module) -> list[float]:
    """Our packed bytes of one expert (gate, up, down, scales) per MoE layer."""
    return [cpu_moe_of(m.experts).packed_bytes / m.experts.spec.num_experts
            for m in moe_layers(model)]


def gguf_expert_bytes(path: str | Path) -> list[float]:
    """The GGUF's bytes of one expert (ffn_gate/up/down_exps blocks) per layer that has them,
    in layer order: what llama.cpp copies per used expert."""
    per_layer: dict[int, float] = {}
    for t in open_gguf(path).reader.tensors:
        parts = t.name.split(".")
        if len(parts) > 2 and parts[0] == "blk" and parts[2] in (
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            experts = int(t.shape[-1])  # gguf shapes are ggml order: ne2 = experts
            layer = int(parts[1])
            per_layer[layer] = per_layer.get(layer, 0.0) + int(t.n_bytes) / experts
    if not per_layer:
        raise ValueError(f"{path}: no ffn_*_exps tensors (not a MoE GGUF)")
    return [per_layer[i] for i in sorted(per_layer)]


def summary(values: list[float]) -> dict[str, float]:
    """min / median / max of `values`, rounded to 0.1."""
    return {"min": round(min(values), 1), "median": round(statistics.median(values), 1),
            "max": round(max(values), 1)}


def count_row(runner: ModelRunner, tokens: int, vocab: int, experts: int,
              bytes_per_expert: dict[str, list[float]], h2d: float | None = None,
              ubatch: int = UBATCH, seed: int = 0) -> dict[str, Any]:
    """One random `tokens`-long prompt (uniform ids, as llama-bench's): the distinct experts per
    MoE layer per ubatch (each layer's list, and min / median / max over layers of its mean),
    and per byte source (e.g. "packed", "gguf": per-expert bytes per MoE layer) the bytes a
    copy of each ubatch's used experts moves per pass, beside every expert per ubatch, and
    with `h2d` (bytes/s) the PCIe floor in tok/s each implies."""
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed))
    per_layer = [distinct_per_ubatch(p, ubatch) for p in routed_picks(runner, ids.tolist())]
    means = [sum(c) / len(c) for c in per_layer]
    row: dict[str, Any] = {
        "tokens": tokens, "ubatch": ubatch, "ubatches": math.ceil(tokens / ubatch),
        "experts": experts, "distinct": summary(means),
        "distinct_mean": round(sum(means) / len(means), 1),
        "distinct_per_layer": per_layer}
    for source, sizes in bytes_per_expert.items():
        if len(sizes) != len(per_layer):
            raise ValueError(f"{source}: bytes for {len(sizes)} MoE layers, the model routes "
                             f"in {len(per_layer)}")
        used = sum(size * sum(c) for size, c in zip(sizes, per_layer, strict=True))
        every = sum(size * experts * len(c) for size, c in zip(sizes, per_layer, strict=True))
        entry: dict[str, Any] = {"used_bytes": int(used), "all_bytes": int(every),
                                 "used_share": round(used / every, 3)}
        if h2d:
            entry["used_floor_tok_s"] = round(tokens * h2d / used, 1)
            entry["all_floor_tok_s"] = round(tokens * h2d / every, 1)
        row[source] = entry
    return row


def count_rows(runner: ModelRunner, config: Any, lengths: list[int], ubatch: int = UBATCH,
               h2d: float | None = None, gguf: Path | None = None) -> list[dict[str, Any]]:
    """`count_row` per length, priced in our packed bytes and the GGUF's."""
    sizes = {"packed": packed_expert_bytes(runner.model)}
    if gguf is not None:
        sizes["gguf"] = gguf_expert_bytes(gguf)
    rows = []
    for n in lengths:
        row = count_row(runner, n, config.vocab_size, int(config.num_experts), sizes, h2d,
                        ubatch)
        rows.append(row)
        brief = {k: v for k, v in row.items() if k != "distinct_per_layer"}
        print(json.dumps({"count": brief}), flush=True)  # progress of a long run
    return rows


def distinct_summary(runner: ModelRunner, config: Any, tokens: int,
                     rows: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Distinct experts per UBATCH tokens of one random `tokens`-long prompt, over the MoE
    layers: the mean, min and max of each layer's mean (the prefill sweep's summary). Taken
    from `rows` (`count_rows`) when one counted that prompt at that ubatch (the same seeded
    ids, so the same count), else counted here: a sweep counts each prompt once."""
    row = next((r for r in rows or [] if (r["tokens"], r["ubatch"]) == (tokens, UBATCH)), None)
    if row is None:
        row = count_row(runner, tokens, config.vocab_size, int(config.num_experts), {})
    return {"mean": row["distinct_mean"], "min": row["distinct"]["min"],
            "max": row["distinct"]["max"]}


def print_counts(rows: list[dict[str, Any]]) -> None:
    """The counts as a markdown table."""
    print("| tokens | distinct experts per ubatch: min / median / max over layers (of E) | "
          "used-experts bytes per pass (packed; gguf) | its PCIe floor tok/s (packed; gguf) |")
    print("|---:|---|---|---|")
    for r in rows:
        d = r["distinct"]
        gb = "; ".join(f"{r[s]['used_bytes'] / 1e9:.2f} GB" for s in ("packed", "gguf") if s in r)
        floor = "; ".join(str(r[s].get("used_floor_tok_s", "")) for s in ("packed", "gguf")
                          if s in r)
        print(f"| {r['tokens']} | {d['min']} / {d['median']} / {d['max']} (of {r['experts']}) | "
              f"{gb} | {floor} |")
