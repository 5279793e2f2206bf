"""llama.cpp's `llama-batched-bench` output read back (benchmarks/serving/batch_peer.sh saves it).

Per (PP prompt tokens, TG generated tokens, B sequences) it prints one row, as a markdown table
(default) or as JSONL (`--output-format jsonl`): T_PP / T_TG / T the prefill, decode and total
seconds, and S_PP = B·PP / T_PP, S_TG = B·TG / T_TG, S = B·(PP + TG) / T their rates. Every
sequence has its own prompt (no `-pps`), all B prefilled first, then decoded in lockstep.
"""

from __future__ import annotations

import json
from typing import Any

FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
"""A row's values, named as in its JSONL (`pl` is B); the markdown table's columns in order."""

HEADER = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
"""The markdown table's column titles."""

INTS = frozenset({"pp", "tg", "pl", "n_kv"})


def parse_batched_bench(text: str, source: str = "llama-batched-bench output"
                        ) -> list[dict[str, Any]]:
    """The rows of `text` (markdown table or JSONL; other lines, such as its log, skipped), each
    as {field: value} of `FIELDS`, in printed order. `source` names the text in errors."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        where = f"{source}, line {number}"
        if line.startswith("{"):
            rows.append(_jsonl_row(line, where))
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if tuple(cells) == HEADER or all(set(c) <= {"-"} for c in cells):
                continue
            if len(cells) != len(FIELDS):
                raise ValueError(f"{where}: a table row of {len(FIELDS)} columns "
                                 f"({', '.join(HEADER)}) expected, found {line!r}")
            rows.append(_typed(dict(zip(FIELDS, cells, strict=True)), where))
    if not rows:
        raise ValueError(f"{source}: no llama-batched-bench rows (a markdown table with columns "
                         f"{', '.join(HEADER)}, or its JSONL)")
    return rows


def output_tok_s(row: dict[str, Any]) -> float:
    """Generated tokens over the whole run, prefill included: B·TG / T (neither S_TG, which
    leaves the prefill out, nor S, which counts prompt tokens too)."""
    return float(row["pl"] * row["tg"] / row["t"])


def _jsonl_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg}): {line[:80]!r}") from None
    missing = [f for f in FIELDS if f not in row]
    if missing:
        raise ValueError(f"{where}: llama-batched-bench JSONL row lacks {', '.join(missing)}")
    return _typed({f: row[f] for f in FIELDS}, where)


def _typed(row: dict[str, Any], where: str) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for field, value in row.items():
        try:
            typed[field] = int(value) if field in INTS else float(value)
        except (TypeError, ValueError):
            kind = "an integer" if field in INTS else "a number"
            raise ValueError(f"{where}: {field} is not {kind}: {value!r}") from None
    return typed
