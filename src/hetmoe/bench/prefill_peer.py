"""Prefill against llama.cpp per prompt length (benchmarks/peers/prefill_vs_llamacpp.py): the
format pairs, llama-bench's ubatches per length, the rows of both sides as points, their
markdown table and PNG, the merge of several calls' JSON (one format per device call), and a
call's JSON rebuilt from the table it printed (`parse_log`: for a call whose JSON was lost).

A call's JSON: {"formats": {fmt: {"ours": {"rows": bench_prefill.py rows, "h2d_gb_s", ...},
"llamacpp": {"rows": budget_peer.parse_rows rows}}}, "calls": [{command, date, git}]}.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PEER_TYPES = {"int4": "q4_0", "int8": "q8_0"}
"""Our expert format -> the llama.cpp block type of like bytes (a scale per 32 weights)."""

DENSE_TYPE = "q8_0"
"""The peer GGUF's attention and embeddings: Q8_0 for both formats, so Q4_0 routes like ours."""

DEFAULT_UBATCH = 512
"""llama.cpp's default ubatch."""

MAX_UBATCH = 16384
"""The largest `-ub` tried (the prompt's length up to this)."""


def parse_formats(text: str) -> list[str]:
    """"int4,int8" -> ["int4", "int8"]; ValueError naming what is not one of PEER_TYPES."""
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in PEER_TYPES]
    if bad or not formats or len(set(formats)) != len(formats):
        raise ValueError(f"--formats takes distinct {', '.join(PEER_TYPES)}, got {text!r}")
    return formats


def parse_lengths(text: str) -> list[int]:
    """"512,4096" -> [512, 4096]: distinct prompt lengths >= 1, ascending."""
    try:
        lengths = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths takes distinct token counts >= 1, got {text!r}")
    return sorted(lengths)


def ubatches(tokens: int) -> list[int]:
    """llama-bench's ubatches for one prompt: its default and the prompt's length (capped)."""
    return sorted({DEFAULT_UBATCH, min(tokens, MAX_UBATCH)})


def llama_point(rows: Sequence[dict[str, Any]], tokens: int) -> dict[str, Any] | None:
    """pp`tokens` tok/s per ubatch, the default ubatch's and the best (with its ubatch); None
    when no row of that prompt is there (cut by the deadline)."""
    pp = {r["n_ubatch"]: r["avg_ts"] for r in rows if r["n_prompt"] == tokens
          and r["n_gen"] == 0}
    if not pp:
        return None
    best = max(pp, key=lambda u: pp[u])
    return {"by_ubatch": {str(u): pp[u] for u in sorted(pp)}, "best": pp[best],
            "best_ubatch": best, "default": pp.get(min(DEFAULT_UBATCH, tokens))}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def points(fmt: dict[str, Any]) -> list[dict[str, Any]]:
    """One format's points per prompt length, ours and llama.cpp's, with ratios: ours (`auto`)
    over the PCIe floor and over llama.cpp's best and default ubatch; the resident-compute line
    as tok/s (tokens over the GPU's expert compute per pass with every expert resident)."""
    ours = {r["tokens"]: r for r in fmt.get("ours", {}).get("rows", [])}
    peer = fmt.get("llamacpp", {}).get("rows", [])
    lengths = sorted(set(ours) | {r["n_prompt"] for r in peer if r["n_gen"] == 0})
    out = []
    for n in lengths:
        row, lp = ours.get(n, {}), llama_point(peer, n) or {}
        compute = row.get("resident_compute_s")
        point = {"tokens": n, "ours_tok_s": row.get("auto_tok_s"),
                 "ours_gpu_experts": row.get("auto_gpu_experts"),
                 "pcie_floor_tok_s": row.get("pcie_floor_tok_s"),
                 "resident_compute_s": compute,
                 "resident_tok_s": round(n / compute, 1) if compute else None,
                 "resident_pass_s": row.get("resident_pass_s"),
                 "llama_default_tok_s": lp.get("default"), "llama_best_tok_s": lp.get("best"),
                 "llama_best_ubatch": lp.get("best_ubatch"),
                 "llama_by_ubatch": lp.get("by_ubatch", {})}
        point["of_floor"] = _ratio(point["ours_tok_s"], point["pcie_floor_tok_s"])
        # A row rebuilt from a printed table keeps its printed ratios (of unrounded tok/s).
        point["over_best"] = row.get("over_best",
                                     _ratio(point["ours_tok_s"], point["llama_best_tok_s"]))
        point["over_default"] = row.get("over_default",
                                        _ratio(point["ours_tok_s"], point["llama_default_tok_s"]))
        out.append(point)
    return out


def _lengths(entry: dict[str, Any]) -> set[int]:
    return ({r["tokens"] for r in entry.get("ours", {}).get("rows", [])}
            | {r["n_prompt"] for r in entry.get("llamacpp", {}).get("rows", [])})


def merge(results: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Several calls' JSON (name, content) as one: their formats side by side, a format split
    over calls by length joined (each row keeps its own call's floor; the header the first
    call's H2D), their calls listed. ValueError when a file is not such a JSON or two files
    hold the same format at the same length."""
    merged: dict[str, Any] = {"formats": {}, "calls": []}
    owner: dict[tuple[str, int], str] = {}
    for name, result in results:
        if not isinstance(result, dict) or "formats" not in result:
            raise ValueError(f"{name}: not a prefill_vs_llamacpp.py JSON (no 'formats')")
        for fmt, entry in result["formats"].items():
            for n in sorted(_lengths(entry)):
                if (fmt, n) in owner:
                    raise ValueError(f"{fmt} at {n} tokens is in both {owner[fmt, n]} and "
                                     f"{name}: pass one of them")
                owner[fmt, n] = name
            into = merged["formats"].setdefault(fmt, {})
            for side in ("ours", "llamacpp"):
                if side in entry:
                    rows = into.get(side, {}).get("rows", []) + entry[side].get("rows", [])
                    into[side] = {**entry[side], **into.get(side, {}), "rows": rows}
        merged["calls"] += [{**c, "file": name} for c in result.get("calls", [])]
    return merged


def _num(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def table(result: dict[str, Any]) -> str:
    """The markdown table of every format's points, a header line per format (its H2D rate and
    bytes per pass, the floor's two terms)."""
    lines = []
    for fmt, entry in result["formats"].items():
        ours = entry.get("ours", {})
        peer = PEER_TYPES[fmt].upper()
        lines += [f"{fmt.upper()} against llama.cpp {peer} (H2D {ours.get('h2d_gb_s', '—')} "
                  f"GB/s, {_num((ours.get('packed_bytes_per_pass') or 0) / 1e9, 1)} GB of "
                  "experts per pass):", "",
                  f"| prompt | hetmoe {fmt.upper()} `auto` (GPU experts/layer) | PCIe floor "
                  f"(ours of it) | resident compute s (tok/s) | resident pass s | llama.cpp "
                  f"{peer} `-ub 512` | llama.cpp best (ubatch) | ours ÷ best | ours ÷ `-ub 512` |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in points(entry):
            experts = "" if p["ours_gpu_experts"] is None else f" ({p['ours_gpu_experts']})"
            of_floor = "" if p["of_floor"] is None else f" ({p['of_floor']:.0%})"
            resident = ("—" if p["resident_compute_s"] is None else
                        f"{p['resident_compute_s']:.3f} ({_num(p['resident_tok_s'])})")
            best = ("—" if p["llama_best_tok_s"] is None else
                    f"{_num(p['llama_best_tok_s'])} ({p['llama_best_ubatch']})")
            lines.append(
                f"| {p['tokens']:,} | {_num(p['ours_tok_s'])}{experts} | "
                f"{_num(p['pcie_floor_tok_s'])}{of_floor} | {resident} | "
                f"{_num(p['resident_pass_s'], 3)} | {_num(p['llama_default_tok_s'])} | {best} | "
                f"**{_x(p['over_best'])}** | {_x(p['over_default'])} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


CALL = re.compile(r"`([^`]+)` \(([^,]+), git (\S+), ([^)]*)\)")
"""One call in a report's "Calls:" line: `command` (date, git SHA, GPU)."""

HEADER = re.compile(r"^(INT\d) against llama\.cpp \S+ \(H2D (\S+) GB/s, (\S+) GB of experts "
                    r"per pass\):$")
"""A format's header line in `table`'s output."""


def _cell(text: str) -> tuple[float | None, float | None]:
    """'1,371 (128)' -> (1371.0, 128.0); '1,394 (98%)' -> (1394.0, None); '—' -> (None, None)."""
    found = re.fullmatch(r"([0-9.,]+|—)(?: \(([0-9.,]+)%?\))?", text.strip())
    if found is None:
        raise ValueError(f"not a table cell of numbers: {text!r}")
    value, inner = found.groups()
    number = None if value == "—" else float(value.replace(",", ""))
    return number, (float(inner.replace(",", "")) if inner and not text.endswith("%)") else None)


def _times(text: str) -> float | None:
    """'**1.08x**' -> 1.08; '—' -> None."""
    value = text.strip("* ")
    if value == "—":
        return None
    if not re.fullmatch(r"[0-9.]+x", value):
        raise ValueError(f"not a ratio cell: {text!r}")
    return float(value[:-1])


def _log_row(cells: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One printed table row -> our row and llama.cpp's rows (its default and best ubatch)."""
    n = int(cells[0].replace(",", ""))
    (ours, experts), (floor, _) = _cell(cells[1]), _cell(cells[2])
    compute, compute_tok_s = _cell(cells[3])
    (resident_pass, _), (default, _), (best, best_ub) = (_cell(c) for c in cells[4:7])
    row = {"tokens": n, "auto_tok_s": ours, "pcie_floor_tok_s": floor,
           "auto_gpu_experts": None if experts is None else int(experts),
           # tokens / the printed tok/s: more digits than the printed seconds
           "resident_compute_s": n / compute_tok_s if compute_tok_s else compute,
           "resident_pass_s": resident_pass, "over_best": _times(cells[7]),
           "over_default": _times(cells[8])}
    peer = {int(best_ub): best} if best is not None and best_ub is not None else {}
    if default is not None:
        peer[min(DEFAULT_UBATCH, n)] = default
    return ({k: v for k, v in row.items() if v is not None},
            [{"n_prompt": n, "n_gen": 0, "n_ubatch": u, "avg_ts": ts} for u, ts in peer.items()])


def parse_log(text: str, name: str) -> dict[str, Any]:
    """A call's JSON rebuilt from the "Calls:" line and the tables `table` printed into its log
    (`name`, for errors): ours' rows (tok/s, GPU experts, floor, resident compute and pass) and
    llama.cpp's default and best ubatch per length. ValueError naming the log and line when it
    holds no such table or a row does not read."""
    result: dict[str, Any] = {"formats": {}, "calls": []}
    entry: dict[str, Any] | None = None
    for i, line in enumerate(text.splitlines(), 1):
        try:
            if line.startswith("Calls: "):
                result["calls"] += [{"command": c, "date": d, "git": g, "machine": {"gpu": gpu},
                                     "source": f"tables printed in {name}"}
                                    for c, d, g, gpu in CALL.findall(line)]
            elif header := HEADER.match(line):
                fmt, h2d, gb = header.groups()
                if fmt.lower() not in PEER_TYPES:
                    raise ValueError(f"format {fmt}: expected one of {', '.join(PEER_TYPES)}")
                entry = result["formats"].setdefault(fmt.lower(), {
                    "ours": {"rows": [], "packed_bytes_per_pass": float(gb) * 1e9},
                    "llamacpp": {"rows": []}})
                if h2d != "—":
                    entry["ours"]["h2d_gb_s"] = float(h2d)
            elif entry is not None and re.match(r"^\| [0-9,]+ \|", line):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) != 9:
                    raise ValueError(f"{len(cells)} cells, the table has 9")
                ours, peer = _log_row(cells)
                entry["ours"]["rows"].append(ours)
                entry["llamacpp"]["rows"] += peer
        except ValueError as exc:
            raise ValueError(f"{name}, line {i}: {exc}") from exc
    if not result["formats"]:
        raise ValueError(f"{name}: no 'INTn against llama.cpp' table in it")
    return result


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    """tok/s against prompt tokens (log x and y): per format ours, llama.cpp's best ubatch, the
    PCIe floor and the resident-compute line, one colour per format."""
    # Here, not at the top: matplotlib loads only to plot, with the Agg backend.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ticks: set[int] = set()
    series = (("ours_tok_s", "-o", "hetmoe {F} auto"),
              ("llama_best_tok_s", "--s", "llama.cpp {P} best ubatch"),
              ("pcie_floor_tok_s", ":", "{F} PCIe floor"),
              ("resident_tok_s", "-.", "{F} resident compute"))
    for colour, (fmt, entry) in zip(("tab:blue", "tab:orange"), result["formats"].items(),
                                    strict=False):
        pts = points(entry)
        ticks |= {p["tokens"] for p in pts}
        for key, style, label in series:
            xy = [(p["tokens"], p[key]) for p in pts if p[key]]
            if xy:
                ax.plot(*zip(*xy, strict=True), style, color=colour,
                        label=label.format(F=fmt.upper(), P=PEER_TYPES[fmt].upper()))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(ticks), [f"{t:,}" for t in sorted(ticks)])  # the lengths, not 2^k
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
