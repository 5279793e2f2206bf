"""The A/B table of source trees (hetmoe.bench.tree_ab) from canned decode_ab.py results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmoe.bench import tree_ab


def write_run(folder: Path, label: str, round_: int, greedy: tuple[float, float],
              prefill: float, imported: str | None = None) -> None:
    """One decode_ab.py JSON: d=0 and d=3 runs (plain = greedy - 1), one prefill row."""
    runs = [{"deferred": d, "greedy_tok_s": g, "plain_tok_s": g - 1.0,
             "read_gb_s_around": [100.0, 100.0]} for d, g in zip((0, 3), greedy, strict=True)]
    result = {"tree": "this", "hetmoe": imported or f"/tmp/ab/{label}/hetmoe",
              "shape": "qwen3-30b-a3b", "weight_format": "int8", "layers": 48, "window": 4160,
              "runs": runs,
              "prefill": [{"tokens": 4096, "mode": "gpu", "tok_s": prefill, "median_s": 0.1,
                           "passes_s": [0.1], "gpu_experts": 128}]}
    (folder / f"{label}_{round_}.json").write_text(json.dumps(result))


def test_means_and_ratios(tmp_path: Path) -> None:
    write_run(tmp_path, "old", 1, (40.0, 50.0), 20000.0)
    write_run(tmp_path, "new", 1, (42.0, 49.0), 21000.0)
    write_run(tmp_path, "old", 2, (44.0, 54.0), 22000.0)
    write_run(tmp_path, "new", 2, (42.0, 53.0), 23100.0)
    rows = tree_ab.summarize(tree_ab.load_runs(tmp_path, ["old", "new"]))
    by_name = {r["metric"]: r for r in rows}
    assert list(by_name) == ["decode greedy tok/s, d=0", "decode plain tok/s, d=0",
                             "decode greedy tok/s, d=3", "decode plain tok/s, d=3",
                             "prefill 4096 tok/s, gpu"]
    greedy0 = by_name["decode greedy tok/s, d=0"]
    assert greedy0["runs"] == {"old": [40.0, 44.0], "new": [42.0, 42.0]}
    assert greedy0["mean"] == {"old": 42.0, "new": 42.0}
    assert greedy0["ratio"] == {"new": 1.0}
    assert by_name["decode plain tok/s, d=3"]["mean"] == {"old": 51.0, "new": 50.0}
    assert by_name["prefill 4096 tok/s, gpu"]["mean"] == {"old": 21000.0, "new": 22050.0}
    assert by_name["prefill 4096 tok/s, gpu"]["ratio"]["new"] == pytest.approx(1.05)


def test_table_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for label, greedy in (("old", (40.0, 50.0)), ("new", (44.0, 45.0)), ("head", (50.0, 55.0))):
        write_run(tmp_path, label, 1, greedy, 20000.0)
    assert tree_ab.main([str(tmp_path), "old", "new", "head"]) == 0
    table = (tmp_path / "ab_table.md").read_text()
    lines = table.splitlines()
    assert lines[0] == ("| metric | old mean (runs) | new mean (runs) | head mean (runs) "
                        "| new / old | head / old |")
    assert lines[2] == "| decode greedy tok/s, d=0 | 40.0 (40.0) | 44.0 (44.0) | 50.0 (50.0) " \
                       "| 1.100 | 1.250 |"
    assert lines[4] == "| decode greedy tok/s, d=3 | 50.0 (50.0) | 45.0 (45.0) | 55.0 (55.0) " \
                       "| 0.900 | 1.100 |"
    assert capsys.readouterr().out == table
    summary = json.loads((tmp_path / "ab_summary.json").read_text())
    assert summary["labels"] == ["old", "new", "head"]
    assert summary["rounds"] == {"old": 1, "new": 1, "head": 1}
    assert summary["layers"] == 48


def test_rounds_in_numeric_order(tmp_path: Path) -> None:
    for round_ in (1, 2, 10):
        write_run(tmp_path, "old", round_, (10.0 + round_, 20.0), 1.0)
        write_run(tmp_path, "new", round_, (20.0, 20.0), 1.0)
    rows = tree_ab.summarize(tree_ab.load_runs(tmp_path, ["old", "new"]))
    assert rows[0]["runs"]["old"] == [11.0, 12.0, 20.0]


def test_a_run_of_another_build_is_refused(tmp_path: Path) -> None:
    write_run(tmp_path, "old", 1, (40.0, 50.0), 1.0)
    write_run(tmp_path, "new", 1, (40.0, 50.0), 1.0, imported="/work/main/src/hetmoe")
    with pytest.raises(ValueError, match=r"new_1.json imported hetmoe from "
                                         r"'/work/main/src/hetmoe', not the new build"):
        tree_ab.load_runs(tmp_path, ["old", "new"])


def test_missing_tree_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, "old", 1, (40.0, 50.0), 1.0)
    assert tree_ab.main([str(tmp_path), "old", "new"]) == 1
    assert capsys.readouterr().err == \
        f"tree_ab: no new_<round>.json in {tmp_path}: did the new runs fail?\n"
    assert tree_ab.main([str(tmp_path), "old"]) == 2


def test_budgets_are_named_apart(tmp_path: Path) -> None:
    """Rows at a GPU expert budget other than 0 get their own metric; budget 0 keeps the old
    names (earlier runs carry no budget)."""
    for label, tok_s in (("old", 200.0), ("new", 210.0)):
        write_run(tmp_path, label, 1, (40.0, 50.0), 20000.0)
        path = tmp_path / f"{label}_1.json"
        result = json.loads(path.read_text())
        result["runs"].append({"budget": "all", "deferred": 0, "greedy_tok_s": tok_s,
                               "plain_tok_s": tok_s - 10, "read_gb_s_around": [1.0, 1.0]})
        path.write_text(json.dumps(result))
    by_name = {r["metric"]: r for r in tree_ab.summarize(tree_ab.load_runs(tmp_path,
                                                                          ["old", "new"]))}
    assert by_name["decode greedy tok/s, d=0"]["mean"] == {"old": 40.0, "new": 40.0}
    assert by_name["decode greedy tok/s, d=0, budget all"]["ratio"]["new"] == pytest.approx(1.05)
    assert by_name["decode plain tok/s, d=0, budget all"]["mean"] == {"old": 190.0, "new": 200.0}
