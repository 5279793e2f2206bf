"""A concurrency sweep of benchmarks/serving/bench_serve.py as series and a PNG: tok/s against
concurrent streams per GPU expert budget, beside llama.cpp's `llama-batched-bench` rows
(bench/batched_bench.py) of the same workload.

Two panels, each pairing like with like. Output: generated tokens over the wall time from the
first request to the last token (ours `tok_s`; llama.cpp B·TG / T). Decode: once every request
has its first token (ours `decode_tok_s`; llama.cpp S_TG = B·TG / T_TG).
"""

from __future__ import annotations

from typing import Any

from hetmoe.bench.batched_bench import output_tok_s

Series = dict[str, list[tuple[int, float]]]
"""label -> [(concurrent streams, tok/s)], by streams."""

PANELS = ("output", "decode")


def sweep_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A bench_serve.py result's points ({budget_gib, streams, tok_s, decode_tok_s, ...}): its
    `points`, or the `together` map of a run from before the sweep (one budget,
    `config.gpu_expert_gib`)."""
    if "points" in result:
        return list(result["points"])
    if "together" in result:
        gib = float(result["config"].get("gpu_expert_gib", 0.0))
        return [{"budget_gib": gib, "streams": int(n), **run}
                for n, run in result["together"].items()]
    raise ValueError("not a bench_serve.py result: it has neither 'points' nor 'together'")


def series(result: dict[str, Any], peers: dict[str, list[dict[str, Any]]]
           ) -> dict[str, Series]:
    """panel ("output", "decode") -> its series: ours per budget, then each peer's (label ->
    llama-batched-bench rows) per (PP, TG) it ran."""
    config = result.get("config", {})
    workload = f"prompt {config.get('prompt_len', '?')}, {config.get('new_tokens', '?')} new"
    fmt = str(config.get("weight_format", "")).upper()
    out: dict[str, Series] = {panel: {} for panel in PANELS}
    for p in sweep_points(result):
        name = f"hetmoe {fmt}, {p['budget_gib']:g} GiB experts on GPU ({workload})"
        out["output"].setdefault(f"{name}: tok_s", []).append((p["streams"], p["tok_s"]))
        out["decode"].setdefault(f"{name}: decode_tok_s", []).append(
            (p["streams"], p["decode_tok_s"]))
    for label, rows in peers.items():
        for r in rows:
            name = f"{label} (prompt {r['pp']}, {r['tg']} new)"
            out["output"].setdefault(f"{name}: B·TG/T", []).append((r["pl"], output_tok_s(r)))
            out["decode"].setdefault(f"{name}: S_TG", []).append((r["pl"], r["speed_tg"]))
    return {panel: {k: sorted(v) for k, v in s.items()} for panel, s in out.items()}


def table(drawn: dict[str, Series]) -> str:
    """The series as text: one line per (panel, label), tok/s per streams."""
    lines = []
    for panel, by_label in drawn.items():
        for label, points in by_label.items():
            values = "  ".join(f"{n}: {y:,.1f}" for n, y in points)
            lines.append(f"{panel:>7} | {label} | {values}")
    return "\n".join(lines)


def plot(result: dict[str, Any], peers: dict[str, list[dict[str, Any]]], path: str
         ) -> dict[str, Series]:
    """Draws `series(result, peers)` into the PNG `path` (log2 streams, log tok/s); returns
    them."""
    # Here, not at the top: matplotlib (a quarter second) loads only to plot, and the Agg
    # backend is chosen for this plot, not for every program that imports hetmoe.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    drawn = series(result, peers)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    titles = {"output": "generated tok/s over the whole run (prefill included)",
              "decode": "decode tok/s (every request past its first token)"}
    for ax, panel in zip(axes, PANELS, strict=True):
        for label, points in drawn[panel].items():
            style = "o-" if label.startswith("hetmoe") else "s--"
            ax.plot([n for n, _ in points], [y for _, y in points], style, label=label)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))  # 1, 2, 4, ..., not 2^k
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(titles[panel], fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    machine = result.get("machine", {})
    shape = result.get("config", {}).get("model") or result.get("config", {}).get("shape", "")
    fig.suptitle(f"{shape}, {machine.get('gpu_name') or 'no GPU'}, {result.get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
