"""Tables and the PNG of a GPU expert budget sweep (benchmarks/engine/gpu_experts_sweep.py).

A sweep's JSON: {"hetmoe": {shape: bench_gpu_experts.py's result}, "llamacpp": {"budgets":
budget_peer.by_budget(...), ...} (absent when llama.cpp did not run)}. A lone
bench_gpu_experts.py result (top-level "rows") reads as a sweep of its shape alone.
"""

from __future__ import annotations

from typing import Any

GB = 1e9

MAIN_SHAPE = "qwen3-30b-a3b"
"""The shape both systems run (llama.cpp's GGUF has its shape)."""


def as_sweep(result: dict[str, Any]) -> dict[str, Any]:
    """A sweep's JSON, or a lone bench_gpu_experts.py result wrapped as one."""
    if "hetmoe" in result:
        return result
    if "rows" not in result:
        raise ValueError("not a sweep JSON (no 'hetmoe') nor a bench_gpu_experts.py result "
                         "(no 'rows')")
    return {"hetmoe": {result.get("shape", MAIN_SHAPE): result}}


def hetmoe_by_budget(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per budget of one bench_gpu_experts.py result (static placement): GPU bytes and share,
    decode tok/s per `decode_key`, and per prompt length the best prefill mode's tok/s with
    that mode (every mode's under `prefill_modes`)."""
    out: dict[str, dict[str, Any]] = {}
    for row in result["rows"]:
        if row.get("placement_interval", 0):
            continue  # static placement's
        entry = out.setdefault(row["budget"], {"gpu_expert_bytes": row["gpu_expert_bytes"],
                                               "gpu_share": row["gpu_share"], "decode": {},
                                               "prefill": {}, "prefill_modes": {}})
        entry["decode"][decode_key(row)] = row["tok_s"]
    for row in result.get("prefill", []):
        if row["budget"] not in out:
            continue
        entry = out[row["budget"]]
        modes = entry["prefill_modes"].setdefault(row["tokens"], {})
        modes[row["mode"]] = row["tok_s"]
        best = max(modes, key=lambda m: modes[m])
        entry["prefill"][row["tokens"]] = (modes[best], best)
    return out


def decode_key(row: dict[str, Any]) -> int | str:
    """A decode row's column: its deferred count in the paper's order ("score"; d=0 defers
    nothing in any order), "<d> <order>" in another (`--defer-order misses`)."""
    order = row.get("defer_order", "score")
    return row["deferred"] if not row["deferred"] or order == "score" else \
        f"{row['deferred']} {order}"


def _decode_keys(ours: dict[str, dict[str, Any]]) -> list[int | str]:
    """Every decode column of `hetmoe_by_budget`, by deferred count then order."""
    keys = {k for e in ours.values() for k in e["decode"]}
    return sorted(keys, key=lambda k: (int(str(k).split()[0]), str(k)))


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "—" if not ours or not theirs else f"{ours / theirs:.2f}x"


def sweep_table(sweep: dict[str, Any], lengths: tuple[int, ...] = (4096, 16384),
                gen: int = 128) -> str:
    """Markdown: one row per budget of the main shape, both systems side by side."""
    ours = hetmoe_by_budget(sweep["hetmoe"][MAIN_SHAPE])
    peer = sweep.get("llamacpp", {}).get("budgets", {})
    deferred = _decode_keys(ours)
    d_head = " / ".join(f"d={d}" for d in deferred)
    head = ["budget", "hetmoe experts on GPU (share)", "llama.cpp `-ncmoe` (experts on GPU)",
            f"hetmoe decode {d_head}", f"llama.cpp tg{gen}", "decode ratio"]
    for n in lengths:
        head += [f"hetmoe prefill {n // 1024}K (mode)", f"llama.cpp pp{n} (ubatch)",
                 f"{n // 1024}K ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for budget, e in ours.items():
        p = peer.get(budget, {})
        decode = max(e["decode"].values())
        cells = [budget, f"{e['gpu_expert_bytes'] / GB:.1f} GB ({e['gpu_share']:.0%})",
                 "—" if not p else f"{p['ncmoe']} ({p['gpu_expert_bytes'] / GB:.1f} GB)",
                 " / ".join(_num(e["decode"].get(d)) for d in deferred),
                 _num(p.get(f"tg{gen}")), _ratio(decode, p.get(f"tg{gen}"))]
        for n in lengths:
            tok_s, mode = e["prefill"].get(n, (None, ""))
            theirs = p.get(f"pp{n}")
            cells += [f"{_num(tok_s, 0)} ({mode})" if tok_s else "—",
                      f"{_num(theirs, 0)} ({p.get(f'pp{n}_ubatch')})" if theirs else "—",
                      _ratio(tok_s, theirs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_layer_table(result: dict[str, Any]) -> str:
    """Markdown for a shape run at a few budgets (DeepSeek-V3's): plan and decode gain, with the
    step time each MoE layer saves against budget 0 (d=0)."""
    ours = hetmoe_by_budget(result)
    layers = result.get("moe_layers") or 1
    base = ours.get("0", {}).get("decode", {}).get(0)
    head = ["budget", "experts on GPU", "experts per layer", "share of routed work",
            "decode d=0 tok/s", "gain over 0 GB", "ms saved per MoE layer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    per_layer = {r["budget"]: r["experts_per_layer"] for r in result["rows"]}
    for budget, e in ours.items():
        tok_s = e["decode"].get(0)
        lo_hi = per_layer.get(budget, ["—"])
        saved = (1e3 * (1 / base - 1 / tok_s) / layers) if base and tok_s else None
        lines.append("| " + " | ".join([
            budget, f"{e['gpu_expert_bytes'] / GB:.2f} GB", "-".join(str(x) for x in
                                                                    sorted(set(lo_hi))),
            f"{e['gpu_share']:.1%}", _num(tok_s, 2), _ratio(tok_s, base),
            _num(saved, 3)]) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str, lengths: tuple[int, ...] = (4096, 16384),
         gen: int = 128) -> None:
    """Decode (left) and prefill (right) tok/s against the GB of experts on the GPU, hetmoe and
    llama.cpp (when it ran), main shape."""
    # Here, not at the top: matplotlib (a quarter second) loads only to plot, and the Agg
    # backend is chosen for this plot, not for every program that imports hetmoe.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = as_sweep(result)
    res = sweep["hetmoe"][MAIN_SHAPE]
    ours = hetmoe_by_budget(res)
    peer = sweep.get("llamacpp", {}).get("budgets", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = [e["gpu_expert_bytes"] / GB for e in ours.values()]
    for d in _decode_keys(ours):
        left.plot(x, [e["decode"].get(d) for e in ours.values()], "o-",
                  label=f"hetmoe {res.get('weight_format', 'int8').upper()}, deferred={d}")
    for n in lengths:
        right.plot(x, [e["prefill"].get(n, (None, ""))[0] for e in ours.values()], "o-",
                   label=f"hetmoe {n // 1024}K")
    if peer:
        px = [p["gpu_expert_bytes"] / GB for p in peer.values()]
        left.plot(px, [p.get(f"tg{gen}") for p in peer.values()], "s--",
                  label=f"llama.cpp Q8_0 tg{gen} (-ncmoe)")
        for n in lengths:
            right.plot(px, [p.get(f"pp{n}") for p in peer.values()], "s--",
                       label=f"llama.cpp pp{n} (best ubatch)")
    for ax, what in ((left, "decode tok/s (batch 1)"), (right, "prefill tok/s")):
        ax.set_xlabel("routed experts on the GPU (GB)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    gpu = res.get("machine", {}).get("gpu", "GPU")
    fig.suptitle(f"Qwen3-30B-A3B shape, random weights, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
