"""The GPU expert budget sweep's CPU parts: llama.cpp's -ncmoe per budget, its command lines and
rows, the tables and PNG from canned results, and benchmarks/engine/gpu_experts_sweep.py end to
end with a stand-in llama-bench (the real one and the hetmoe stages need the device)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from bench_script import load_script

from hetmoe.bench import llama_kit
from hetmoe.bench.budget_peer import (
    bench_args,
    by_budget,
    ncmoe_for,
    parse_budgets,
    parse_rows,
    peer_budgets,
    q8_0_layer_bytes,
)
from hetmoe.bench.budget_report import hetmoe_by_budget, per_layer_table, plot, sweep_table

SCRIPT = "engine/gpu_experts_sweep.py"
LAYER = 641_728_512
"""Q8_0 bytes of one Qwen3-30B-A3B MoE layer's experts: 3 x 128 x 2048 x 768 x 34 / 32."""


def test_q8_0_layer_bytes_and_ncmoe_per_budget() -> None:
    assert q8_0_layer_bytes("qwen3-30b-a3b") == LAYER
    got = [(p.budget, p.ncmoe, p.gpu_layers, p.gpu_expert_bytes)
           for p in peer_budgets(parse_budgets("0,8,15,23,all"), "qwen3-30b-a3b")]
    # 15 GB: 23 layers (14.76 GB) fit, 24 (15.40 GB) do not.
    assert got == [("0", 48, 0, 0), ("8", 36, 12, 12 * LAYER), ("15", 25, 23, 23 * LAYER),
                   ("23", 13, 35, 35 * LAYER), ("all", 0, 48, 48 * LAYER)]
    assert ncmoe_for("15.4", LAYER, 48).gpu_layers == 23  # 24 x LAYER = 15.40 GB > 15.4e9
    assert ncmoe_for("15.41", LAYER, 48).gpu_layers == 24
    assert ncmoe_for("1000", LAYER, 48).ncmoe == 0
    deepseek = peer_budgets(["8"], "deepseek-v3-few-layers")[0]  # 3 MoE layers of 12 GB
    assert (deepseek.ncmoe, deepseek.gpu_layers) == (3, 0)
    with pytest.raises(ValueError, match="layer bytes and layers must be positive, got 0, 48"):
        ncmoe_for("8", 0, 48)


@pytest.mark.parametrize(("text", "message"), [
    ("", "--budgets needs at least one of GB >= 0 or all, got ''"),
    ("0,x", "--budgets takes GB >= 0 or all, got 'x' in '0,x'"),
    ("-1", "--budgets takes GB >= 0 or all, got '-1' in '-1'"),
    ("8,8", "--budgets lists a budget twice: '8,8'"),
])
def test_bad_budgets_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_budgets(text)


def test_bench_args() -> None:
    assert bench_args("m.gguf", [48, 0], 15, 4096, 128, [512, 4096], 2) == [
        "-m", "m.gguf", "-ngl", "99", "-ncmoe", "48,0", "-t", "15", "-p", "4096", "-n", "128",
        "-b", "4096", "-ub", "512,4096", "-r", "2", "-lm", "none", "-o", "jsonl"]
    with pytest.raises(ValueError, match=r"needs -ncmoe values, ubatches, reps >= 1 and "
                                         r"threads >= 1, got \[\], \[512\], 1, 15"):
        bench_args("m.gguf", [], 15, 4096, 128, [512], 1)


def jsonl(ncmoe: int, prompt: int, gen: int, ubatch: int, tok_s: float) -> str:
    """One llama-bench JSONL line as its printer writes it (ints bare, strings quoted)."""
    return json.dumps({"build_commit": "abc", "model_type": "qwen3moe 30B.A3B Q8_0",
                       "n_batch": max(ubatch, 2048), "n_ubatch": ubatch, "n_threads": 15,
                       "n_cpu_moe": ncmoe, "load_mode": "none", "n_prompt": prompt,
                       "n_gen": gen, "avg_ts": tok_s, "stddev_ts": 0.5,
                       "samples_ns": [1, 2], "samples_ts": [tok_s, tok_s]})


def test_rows_by_budget_keep_the_best_ubatch() -> None:
    text = "\n".join(["llama-bench: loading", jsonl(48, 4096, 0, 512, 810.0),
                      jsonl(48, 4096, 0, 4096, 4196.0), jsonl(48, 0, 128, 512, 28.0),
                      jsonl(48, 0, 128, 4096, 27.5), jsonl(0, 4096, 0, 512, 7220.0)])
    rows = parse_rows(text)
    assert len(rows) == 5 and rows[0]["n_cpu_moe"] == 48 and rows[0]["samples_ts"] == [810.0] * 2
    got = by_budget(peer_budgets(["0", "8", "all"], "qwen3-30b-a3b"), rows)
    assert got["0"]["tg128"] == 28.0
    assert (got["0"]["pp4096"], got["0"]["pp4096_ubatch"]) == (4196.0, 4096)
    assert got["0"]["pp4096_by_ubatch"] == {"512": 810.0, "4096": 4196.0}
    assert got["0"]["pp16384"] is None
    assert got["8"]["tg128"] is None and got["8"]["ncmoe"] == 36  # cut by the deadline
    assert got["all"]["pp4096"] == 7220.0 and got["all"]["tg128"] is None
    with pytest.raises(ValueError, match="llama-bench row lacks avg_ts, stddev_ts"):
        parse_rows('{"n_cpu_moe": 1, "n_prompt": 0, "n_gen": 1, "n_batch": 1, "n_ubatch": 1, '
                   '"n_threads": 1, "samples_ts": []}')


def hetmoe_result(shape: str, budgets: dict[str, tuple[int, float, float]],
                  prefill: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A bench_gpu_experts.py result: budget -> (bytes, d=0 tok/s, d=3 tok/s); prefill rows."""
    rows = []
    for budget, (size, d0, d3) in budgets.items():
        for d, tok_s in ((0, d0), (3, d3)):
            rows.append({"budget": budget, "deferred": d, "placement_interval": 0,
                         "gpu_expert_bytes": size, "gpu_share": size / 30.8e9,
                         "experts_per_layer": [size // 10**9, size // 10**9], "tok_s": tok_s})
    pre = [{"budget": b, "gpu_expert_bytes": budgets[b][0], "mode": mode, "tokens": int(n),
            "tok_s": tok_s} for b, modes in prefill.items() for key, tok_s in modes.items()
           for n, mode in [key.split(":")]]
    return {"shape": shape, "weight_format": "int8", "moe_layers": 3, "rows": rows,
            "prefill": pre, "machine": {"gpu": "H100"}}


def canned_sweep() -> dict[str, Any]:
    qwen = hetmoe_result("qwen3-30b-a3b", {"0": (0, 50.0, 60.0), "8": (8 * 10**9, 66.0, 69.0),
                                           "all": (30_800_000_000, 123.0, 80.0)},
                         {"0": {"4096:auto": 6700.0, "4096:cpu": 3000.0},
                          "all": {"4096:auto": 9000.0, "16384:auto": 9500.0}})
    deepseek = hetmoe_result("deepseek-v3-few-layers", {"0": (0, 10.0, 11.0),
                                                        "8": (8 * 10**9, 12.5, 12.0)}, {})
    rows = parse_rows("\n".join([jsonl(48, 0, 128, 512, 25.0), jsonl(48, 4096, 0, 4096, 4000.0),
                                 jsonl(0, 0, 128, 512, 246.0), jsonl(0, 4096, 0, 512, 7200.0),
                                 jsonl(0, 16384, 0, 16384, 6000.0)]))
    peers = peer_budgets(["0", "8", "all"], "qwen3-30b-a3b")
    return {"command": "sweep", "date": "today", "git": "abc", "timings": {"hetmoe": (1, "ok")},
            "hetmoe": {"qwen3-30b-a3b": qwen, "deepseek-v3-few-layers": deepseek},
            "llamacpp": {"budgets": by_budget(peers, rows), "rows": rows}}


def test_the_budget_table_keeps_each_deferral_order_in_its_column() -> None:
    result = hetmoe_result("qwen3-30b-a3b", {"0": (0, 50.0, 60.0)}, {})
    result["rows"].append({**result["rows"][1], "defer_order": "misses", "tok_s": 99.0})
    assert hetmoe_by_budget(result)["0"]["decode"] == {0: 50.0, 3: 60.0, "3 misses": 99.0}
    sweep = {"hetmoe": {"qwen3-30b-a3b": result}}
    table = sweep_table(sweep).splitlines()
    assert "hetmoe decode d=0 / d=3 / d=3 misses" in table[0]
    assert table[2].split(" | ")[3:6] == ["50.0 / 60.0 / 99.0", "—", "—"]


def test_the_budget_table_keeps_d0_whatever_order_recorded_it() -> None:
    """bench_gpu_experts.py runs d=0 once, under the first of --defer-orders: with "misses"
    first its exact-decode row is still the table's d=0 (it defers nothing in either order)."""
    result = hetmoe_result("qwen3-30b-a3b", {"0": (0, 50.0, 60.0)}, {})
    result["rows"][0]["defer_order"] = "misses"
    result["rows"][1]["defer_order"] = "misses"
    assert hetmoe_by_budget(result)["0"]["decode"] == {0: 50.0, "3 misses": 60.0}


def test_tables_from_a_canned_sweep() -> None:
    table = sweep_table(canned_sweep()).splitlines()
    assert table[0].startswith("| budget | hetmoe experts on GPU (share) | llama.cpp `-ncmoe`")
    assert "hetmoe decode d=0 / d=3" in table[0] and "llama.cpp pp16384 (ubatch)" in table[0]
    assert table[2] == ("| 0 | 0.0 GB (0%) | 48 (0.0 GB) | 50.0 / 60.0 | 25.0 | 2.40x | "
                        "6,700 (auto) | 4,000 (4096) | 1.68x | — | — | — |")
    assert table[3].startswith("| 8 | 8.0 GB (26%) | 36 (7.7 GB) | 66.0 / 69.0 | — | — |")
    assert table[4] == ("| all | 30.8 GB (100%) | 0 (30.8 GB) | 123.0 / 80.0 | 246.0 | 0.50x | "
                        "9,000 (auto) | 7,200 (512) | 1.25x | 9,500 (auto) | 6,000 (16384) | "
                        "1.58x |")
    per_layer = per_layer_table(canned_sweep()["hetmoe"]["deepseek-v3-few-layers"]).splitlines()
    # 1 / 10 - 1 / 12.5 s = 20 ms a token, over 3 MoE layers.
    assert per_layer[3] == "| 8 | 8.00 GB | 8 | 26.0% | 12.50 | 1.25x | 6.667 |"


def test_plot_of_a_sweep_and_of_a_lone_result(tmp_path: Path) -> None:
    plot(canned_sweep(), str(tmp_path / "sweep.png"))
    plot(canned_sweep()["hetmoe"]["qwen3-30b-a3b"], str(tmp_path / "lone.png"))
    for name in ("sweep.png", "lone.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="not a sweep JSON"):
        plot({"x": 1}, str(tmp_path / "bad.png"))




FAKE_BENCH = """#!{python}
# Stands in for llama-bench: one JSONL row per (-ncmoe, ubatch, test) of its arguments.
import json, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
for n in a["-ncmoe"].split(","):
    for ub in a["-ub"].split(","):
        for p, g in ((int(a["-p"]), 0), (0, int(a["-n"]))):
            if p or g:
                print(json.dumps({{"n_cpu_moe": int(n), "n_prompt": p, "n_gen": g,
                    "n_batch": int(a["-b"]), "n_ubatch": int(ub), "n_threads": int(a["-t"]),
                    "avg_ts": 1000.0 - int(n) + int(ub) / 1000 + g, "stddev_ts": 0.0,
                    "samples_ts": []}}))
"""


def test_sweep_end_to_end_with_a_stand_in_llama_bench(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    kit = tmp_path / "peers" / "lcpp"
    kit.mkdir(parents=True)
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH.format(python=sys.executable))
    os.chmod(fake, 0o755)
    with tarfile.open(kit / "prebuilt.tar.xz", "w:xz") as tar:
        tar.add(fake, arcname="llama-bench")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    module = load_script(SCRIPT)
    monkeypatch.setattr(llama_kit, "SAP_RAPIDS", ())  # the stand-in runs on any CPU
    out = tmp_path / "out"
    module.main(["--peer-dir", str(tmp_path / "peers"), "--out", str(out), "--stages",
                 "llamacpp,pp16k", "--budgets", "0,15,all", "--gguf", str(gguf)])
    sweep = json.loads((out / "gpu_experts_sweep.json").read_text())
    assert [s for _, s in sweep["timings"].values()] == ["ok", "ok", "ok"]
    assert list(sweep["timings"]) == ["llamacpp_setup", "llamacpp", "pp16k"]
    budgets = sweep["llamacpp"]["budgets"]
    assert [budgets[b]["ncmoe"] for b in ("0", "15", "all")] == [48, 25, 0]
    assert budgets["15"]["tg128"] == 1000.0 - 25 + 4.096 + 128  # the best ubatch's row
    assert (budgets["15"]["pp4096"], budgets["15"]["pp4096_ubatch"]) == (975 + 4.096, 4096)
    assert budgets["all"]["pp16384"] == 1000.0 + 16.384
    assert gguf.exists()  # a given GGUF is kept
    assert "Stage seconds: llamacpp_setup" in capsys.readouterr().out
    module.main(["--out", str(out), "--report"])
    assert (out / "gpu_experts_sweep.md").read_text().startswith("Command: `benchmarks/engine/")


def test_sweep_arguments_are_checked_before_any_work(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    module = load_script(SCRIPT)
    for argv, message in (
            (["--stages", "llamacpp"], "--peer-dir is needed for the llama.cpp stages"),
            (["--stages", "hetmoe,x"], "--stages: unknown x (hetmoe, llamacpp, deepseek, pp16k)"),
            (["--stages", "hetmoe", "--budgets", "0,x"], "--budgets takes GB >= 0 or all, got"),
            (["--stages", "hetmoe", "--lcpp-ubatch", "big"], "invalid literal for int()")):
        with pytest.raises(SystemExit):
            module.parse_args(["--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
    args = module.parse_args(["--out", str(tmp_path), "--peer-dir", "p"])
    assert args.stages == ["hetmoe", "llamacpp", "deepseek", "pp16k"]
    assert (args.budgets, args.deferred, args.prefill, args.new_tokens, args.defer_orders) == (
        "0,8,15,23,all", "0,3", "4096,16384", 48, "misses")
