"""The table of an A/B of source trees (benchmarks/engine/ab_trees.sh): decode_ab.py's runs,
one JSON per tree per round (`<label>_<round>.json`), as means per tree and ratios to the first.

    python -m hetmoe.bench.tree_ab OUT_DIR old new [head]

prints a markdown table and writes `ab_table.md` and `ab_summary.json` into OUT_DIR. Each run
must have imported its own tree's build (the folder named by its label): a run that imported
another hetmoe is refused, since its numbers would compare a tree with itself.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def load_runs(folder: Path, labels: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each label's decode_ab.py results in round order, checked to come from its own build."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for label in labels:
        files = sorted(folder.glob(f"{label}_*.json"), key=lambda p: int(p.stem.split("_")[-1]))
        if not files:
            raise ValueError(f"no {label}_<round>.json in {folder}: did the {label} runs fail?")
        runs[label] = []
        for path in files:
            result = json.loads(path.read_text())
            imported = Path(result.get("hetmoe", "?")).parent.name
            if imported != label:
                raise ValueError(f"{path.name} imported hetmoe from {result.get('hetmoe')!r}, "
                                 f"not the {label} build: its numbers are not the {label} tree's")
            runs[label].append(result)
    return runs


def metrics(result: dict[str, Any]) -> dict[str, float]:
    """One run's figures by name: greedy and plain decode tok/s per `deferred` and GPU expert
    budget (the mean of the run's repeats; budget 0, the default, goes unnamed) and prefill
    tok/s per (length, mode)."""
    per: dict[str, list[float]] = {}
    for row in result["runs"]:
        d, budget = row["deferred"], str(row.get("budget", "0"))
        at = f"d={d}" if budget == "0" else f"d={d}, budget {budget}"
        per.setdefault(f"decode greedy tok/s, {at}", []).append(row["greedy_tok_s"])
        per.setdefault(f"decode plain tok/s, {at}", []).append(row["plain_tok_s"])
    for row in result.get("prefill", []):
        per.setdefault(f"prefill {row['tokens']} tok/s, {row['mode']}", []).append(row["tok_s"])
    return {name: statistics.fmean(values) for name, values in per.items()}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """Per metric: every tree's runs, their mean, and each mean over the first tree's."""
    labels = list(runs)
    per_run = {label: [metrics(r) for r in results] for label, results in runs.items()}
    names = list(dict.fromkeys(n for m in per_run[labels[0]] for n in m))
    rows = []
    for name in names:
        values = {label: [m[name] for m in per_run[label] if name in m] for label in labels}
        if not all(values.values()):
            continue  # a figure some tree never measured has no ratio
        means = {label: statistics.fmean(v) for label, v in values.items()}
        base = means[labels[0]]
        rows.append({"metric": name, "runs": values, "mean": means,
                     "ratio": {label: means[label] / base for label in labels[1:]}})
    return rows


def markdown(rows: list[Row], labels: list[str]) -> str:
    """The table: mean (runs) per tree, then each tree's mean over the first tree's."""
    base = labels[0]
    head = ["metric", *(f"{label} mean (runs)" for label in labels),
            *(f"{label} / {base}" for label in labels[1:])]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for row in rows:
        cells = [row["metric"]]
        for label in labels:
            runs = ", ".join(f"{v:.1f}" for v in row["runs"][label])
            cells.append(f"{row['mean'][label]:.1f} ({runs})")
        cells += [f"{row['ratio'][label]:.3f}" for label in labels[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m hetmoe.bench.tree_ab OUT_DIR LABEL LABEL [LABEL...]",
              file=sys.stderr)
        return 2
    folder, labels = Path(argv[0]), argv[1:]
    try:
        runs = load_runs(folder, labels)
    except ValueError as exc:
        print(f"tree_ab: {exc}", file=sys.stderr)
        return 1
    rows = summarize(runs)
    table = markdown(rows, labels)
    (folder / "ab_table.md").write_text(table)
    first = runs[labels[0]][0]
    (folder / "ab_summary.json").write_text(json.dumps(
        {"labels": labels, "shape": first["shape"], "weight_format": first["weight_format"],
         "layers": first.get("layers"), "rounds": {k: len(v) for k, v in runs.items()},
         "rows": rows}, indent=1))
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
