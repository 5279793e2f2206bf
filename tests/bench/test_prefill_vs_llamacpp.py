"""benchmarks/peers/prefill_vs_llamacpp.py on the CPU: its points, ratios, table, merge and PNG
from canned rows, and the whole call with stand-ins for bench_prefill.py (ours needs a GPU) and
for the peer kit (llama-bench and make_gguf.py), a call cut by its deadline included; what OUT
holds (a handful of files, the kit and logs in the work folder); the figure redrawn from two
device calls' logs (data/, copies of 2026-11-27's, whose JSON did not come back)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from bench_script import load_script

from hetmoe.bench import llama_kit
from hetmoe.bench.budget_peer import parse_rows
from hetmoe.bench.prefill_peer import (
    llama_point,
    merge,
    parse_lengths,
    parse_log,
    plot,
    points,
    table,
)

SCRIPT = "peers/prefill_vs_llamacpp.py"
PNG = b"\x89PNG\r\n\x1a\n"
DATA = Path(__file__).parent / "data"
OUT_FILES = ["prefill_vs_llamacpp.json", "prefill_vs_llamacpp.md", "prefill_vs_llamacpp.png",
             "prefill_vs_llamacpp_logs.tgz"]
"""Everything a call leaves in --out."""


def lcpp_row(prompt: int, ubatch: int, tok_s: float) -> dict[str, Any]:
    """One llama-bench JSONL row as parse_rows keeps it (pp only, experts of 48 layers on CPU)."""
    return {"n_cpu_moe": 48, "n_prompt": prompt, "n_gen": 0, "n_batch": max(prompt, ubatch),
            "n_ubatch": ubatch, "n_threads": 15, "avg_ts": tok_s, "stddev_ts": 1.0,
            "samples_ts": [tok_s]}


def fmt_entry(scale: float = 1.0) -> dict[str, Any]:
    """One format's canned rows: ours at 512 and 4096, llama.cpp at 512, 4096 and 16384."""
    ours = [{"tokens": 512, "auto_tok_s": 1000.0 * scale, "auto_gpu_experts": 64,
             "pcie_floor_tok_s": 1250.0 * scale, "resident_compute_s": 0.1},
            {"tokens": 4096, "auto_tok_s": 10000.0 * scale, "auto_gpu_experts": 128,
             "pcie_floor_tok_s": 11000.0 * scale, "resident_compute_s": 0.2,
             "resident_pass_s": 0.25}]
    peer = [lcpp_row(512, 512, 800.0), lcpp_row(4096, 512, 1000.0),
            lcpp_row(4096, 4096, 5000.0), lcpp_row(16384, 16384, 4000.0)]
    return {"ours": {"rows": ours, "h2d_gb_s": 55.0, "packed_bytes_per_pass": 19.9e9},
            "llamacpp": {"rows": peer}}


def test_points_ratios_floors_and_the_resident_line() -> None:
    p512, p4k, p16k = points(fmt_entry())
    assert (p512["ours_tok_s"], p512["llama_default_tok_s"], p512["llama_best_tok_s"]) == (
        1000.0, 800.0, 800.0)
    assert (p512["over_best"], p512["over_default"], p512["of_floor"]) == (1.25, 1.25, 0.8)
    assert p512["resident_tok_s"] == 5120.0  # 512 tokens / 0.1 s
    assert (p4k["llama_best_tok_s"], p4k["llama_best_ubatch"]) == (5000.0, 4096)
    assert p4k["llama_by_ubatch"] == {"512": 1000.0, "4096": 5000.0}
    assert (p4k["over_best"], p4k["over_default"]) == (2.0, 10.0)
    assert (p4k["resident_tok_s"], p4k["resident_pass_s"]) == (20480.0, 0.25)
    # 16K: llama.cpp's row only (ours cut by its deadline): no ratio, its default ubatch absent.
    assert p16k["ours_tok_s"] is None and p16k["over_best"] is None
    assert (p16k["llama_best_tok_s"], p16k["llama_default_tok_s"]) == (4000.0, None)
    assert llama_point([lcpp_row(512, 512, 1.0)], 1024) is None


def test_table_merge_and_plot(tmp_path: Path) -> None:
    a = {"formats": {"int4": fmt_entry()}, "calls": [{"command": "a", "date": "d", "git": "g"}]}
    b = {"formats": {"int8": fmt_entry(2.0)}, "calls": [{"command": "b", "date": "d", "git": "g"}]}
    merged = merge([("a.json", a), ("b.json", b)])
    assert list(merged["formats"]) == ["int4", "int8"]
    assert [c["file"] for c in merged["calls"]] == ["a.json", "b.json"]
    lines = table(merged).splitlines()
    assert lines[0] == ("INT4 against llama.cpp Q4_0 (H2D 55.0 GB/s, 19.9 GB of experts per "
                        "pass):")
    assert lines[4] == ("| 512 | 1,000 (64) | 1,250 (80%) | 0.100 (5,120) | — | 800 | 800 (512) "
                        "| **1.25x** | 1.25x |")
    assert lines[5] == ("| 4,096 | 10,000 (128) | 11,000 (91%) | 0.200 (20,480) | 0.250 | 1,000 "
                        "| 5,000 (4096) | **2.00x** | 10.00x |")
    assert lines[6].startswith("| 16,384 | — | — | — | — | — | 4,000 (16384) | **—** |")
    assert "INT8 against llama.cpp Q8_0" in lines[8]
    assert lines[13].endswith("| **4.00x** | 20.00x |")  # int8's ours doubled: 20,000 / 1,000
    plot(merged, tmp_path / "fig.png", "t")
    assert (tmp_path / "fig.png").read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="^int4 at 512 tokens is in both a.json and c.json: "
                                         "pass one of them$"):
        merge([("a.json", a), ("c.json", a)])
    # One format over two calls, by length: joined, each row with its own call's floor.
    short, long = fmt_entry(), fmt_entry()
    short["llamacpp"]["rows"] = short["llamacpp"]["rows"][:3]
    long["ours"] = {"rows": [{"tokens": 16384, "auto_tok_s": 20000.0,
                              "pcie_floor_tok_s": 40000.0}], "h2d_gb_s": 50.0}
    long["llamacpp"]["rows"] = long["llamacpp"]["rows"][3:]
    joined = merge([("s.json", {"formats": {"int4": short}}),
                    ("l.json", {"formats": {"int4": long}})])["formats"]["int4"]
    assert joined["ours"]["h2d_gb_s"] == 55.0  # the first call's
    assert [(p["tokens"], p["over_best"], p["of_floor"]) for p in points(joined)] == [
        (512, 1.25, 0.8), (4096, 2.0, 0.909), (16384, 5.0, 0.5)]
    with pytest.raises(ValueError, match=r"^x.json: not a prefill_vs_llamacpp.py JSON"):
        merge([("x.json", {"rows": []})])
    with pytest.raises(ValueError, match=r"--lengths takes distinct token counts >= 1, got '0'"):
        parse_lengths("0")


FAKE_PREFILL = """import argparse, json, os, sys, time
p = argparse.ArgumentParser()
for a in ("--shape", "--weight-format", "--lengths", "--modes", "--repeats", "--out"):
    p.add_argument(a)
p.add_argument("--resident-pass", action="store_true")
a = p.parse_args()
assert (a.shape, a.modes) == ("qwen3-30b-a3b", "auto"), sys.argv
rows = []
for i, n in enumerate(int(x) for x in a.lengths.split(",")):
    if i and os.environ.get("FAKE_HANG"):
        time.sleep(60)
    rows.append({"tokens": n, "auto_tok_s": 2.0 * n, "auto_gpu_experts": 128,
                 "pcie_floor_tok_s": 4.0 * n, "resident_compute_s": 0.01})
    print("{not json either"); print(json.dumps(rows[-1]), flush=True)
for r in rows if a.resident_pass else []:
    print(json.dumps({"tokens": r["tokens"], "resident_pass_s": 0.5}), flush=True)
with open(os.path.join(a.out, "prefill_qwen3-30b-a3b_" + a.weight_format + ".json"), "w") as f:
    json.dump({"rows": rows, "h2d_gb_s": 55.5, "packed_bytes_per_pass": 10**9}, f)
"""

FAKE_BENCH = """#!{python}
# Stands in for llama-bench: one JSONL row per ubatch of -p, tok/s = prompt + ubatch / 8.
import json, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert a["-ncmoe"] == "48" and a["-n"] == "0" and a["-ngl"] == "99", sys.argv
for ub in a["-ub"].split(","):
    p = int(a["-p"])
    print(json.dumps({{"n_cpu_moe": 48, "n_prompt": p, "n_gen": 0, "n_batch": int(a["-b"]),
        "n_ubatch": int(ub), "n_threads": int(a["-t"]), "avg_ts": p + int(ub) / 8,
        "stddev_ts": 0.0, "samples_ts": []}}))
"""

FAKE_GGUF = "import sys; open(sys.argv[sys.argv.index('-o') + 1], 'w').write(' '.join(sys.argv))\n"


def fake_kit(tmp_path: Path) -> Path:
    """A peer kit whose llama-bench and make_gguf.py are the stand-ins above."""
    kit = tmp_path / "peers"
    (kit / "lcpp").mkdir(parents=True)
    bench = tmp_path / "llama-bench"
    bench.write_text(FAKE_BENCH.format(python=sys.executable))
    os.chmod(bench, 0o755)
    with tarfile.open(kit / "lcpp" / "prebuilt.tar.xz", "w:xz") as tar:
        tar.add(bench, arcname="llama-bench")
    with tarfile.open(kit / "lcpp" / "src.tar.gz", "w:gz") as tar:
        for name in ("llama.cpp/gguf-py/gguf/__init__.py",
                     "llama.cpp/models/ggml-vocab-qwen2.gguf"):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    (kit / "make_gguf.py").write_text(FAKE_GGUF)
    return kit


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    script = load_script(SCRIPT)
    fake = tmp_path / "bench_prefill.py"
    fake.write_text(FAKE_PREFILL)
    monkeypatch.setattr(script, "PREFILL_SCRIPT", fake)
    monkeypatch.setattr(llama_kit, "SAP_RAPIDS", ())  # the stand-in runs on any CPU
    return script


def test_a_call_with_stand_ins_and_its_plot_only_merge(module: Any, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    kit, out, work = fake_kit(tmp_path), tmp_path / "out", tmp_path / "work"
    module.main(["--peer-dir", str(kit), "--formats", "int4", "--lengths", "4096,512,16384",
                 "--out", str(out), "--work", str(work)])
    assert sorted(os.listdir(out)) == OUT_FILES
    assert (work / "lcpp" / "bin" / "llama-bench").is_file()  # the kit in the work folder
    logs = ["gguf_int4.log", *(f"lcpp_int4_{n}.{x}" for n in (16384, 4096, 512)
                               for x in ("jsonl", "log")), "ours_int4.log",
            "prefill_qwen3-30b-a3b_int4.json"]
    with tarfile.open(out / "prefill_vs_llamacpp_logs.tgz") as tar:
        assert sorted(tar.getnames()) == sorted(logs)
        rows = tar.extractfile("lcpp_int4_512.jsonl")
        assert rows is not None and json.loads(rows.read())["n_prompt"] == 512
    result = json.loads((out / "prefill_vs_llamacpp.json").read_text())
    assert list(result["timings"]) == ["int4/ours", "int4/llamacpp"]
    assert [t[1] for t in result["timings"].values()] == ["ok", "ok"]
    entry = result["formats"]["int4"]
    assert entry["ours"]["h2d_gb_s"] == 55.5
    assert [(r["tokens"], r["resident_pass_s"]) for r in entry["ours"]["rows"]] == [
        (512, 0.5), (4096, 0.5), (16384, 0.5)]
    peer = entry["llamacpp"]
    assert [(r["n_prompt"], r["n_ubatch"]) for r in peer["rows"]] == [
        (512, 512), (4096, 512), (4096, 4096), (16384, 512), (16384, 16384)]
    assert list(peer["calls"]) == ["512", "4096", "16384"]
    printed = capsys.readouterr().out
    (make_gguf,) = [line for line in printed.splitlines() if "make_gguf.py" in line]
    assert "--layers 48 --type q4_0 --dense-type q8_0" in make_gguf
    gguf = Path(make_gguf.split(" -o ")[1].split()[0])
    assert gguf.name == "peer_qwen3_48L_q4_0_q8_0.gguf" and not gguf.exists()  # removed (tmpfs)
    (p4k,) = [p for p in points(entry) if p["tokens"] == 4096]
    assert (p4k["ours_tok_s"], p4k["llama_best_tok_s"], p4k["llama_best_ubatch"]) == (
        8192.0, 4608.0, 4096)
    assert p4k["over_best"] == round(8192 / 4608, 3) and p4k["of_floor"] == 0.5
    assert (out / "prefill_vs_llamacpp.png").read_bytes()[:8] == PNG
    assert "| 4,096 | 8,192 (128) | 16,384 (50%) |" in printed
    other = tmp_path / "int8.json"
    other.write_text(json.dumps({"formats": {"int8": fmt_entry()}, "calls": []}))
    merged_dir = tmp_path / "merged"
    module.main(["--plot-only", str(out / "prefill_vs_llamacpp.json"), str(other), "--out",
                 str(merged_dir)])
    merged = json.loads((merged_dir / "prefill_vs_llamacpp.json").read_text())
    assert list(merged["formats"]) == ["int4", "int8"]
    assert (merged_dir / "prefill_vs_llamacpp.md").read_text().count("against llama.cpp") == 2
    assert (merged_dir / "prefill_vs_llamacpp.png").read_bytes()[:8] == PNG


def test_a_call_cut_by_its_deadline_keeps_the_points_that_finished(
        module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_HANG", "1")  # ours hangs after its first length
    out, temp = tmp_path / "out", tmp_path / "temp"

    def mkdtemp(prefix: str) -> str:
        temp.mkdir()
        return str(temp)

    monkeypatch.setattr(module.tempfile, "mkdtemp", mkdtemp)
    module.main(["--stages", "ours", "--formats", "int8", "--lengths", "512,4096",
                 "--deadline", "3", "--out", str(out)])
    assert not temp.exists()  # the default work folder, removed at the end
    assert sorted(os.listdir(out)) == OUT_FILES
    with tarfile.open(out / "prefill_vs_llamacpp_logs.tgz") as tar:
        assert tar.getnames() == ["ours_int8.log"]
    result = json.loads((out / "prefill_vs_llamacpp.json").read_text())
    assert result["timings"]["int8/ours"][1] == "timed out"
    assert [r["tokens"] for r in result["formats"]["int8"]["ours"]["rows"]] == [512]
    assert "h2d_gb_s" not in result["formats"]["int8"]["ours"]  # its final JSON never came


@pytest.mark.parametrize(("argv", "message"), [
    (["--formats", "int3"], "--formats takes distinct int4, int8, got 'int3'"),
    (["--lengths", "512,x"], "--lengths takes distinct token counts >= 1, got '512,x'"),
    (["--stages", "ours,kt"], "--stages takes ours, llamacpp or both, got ['ours', 'kt']"),
    (["--stages", "ours", "--deadline", "0"], "--deadline must be > 0 s"),
    ([], "--peer-dir is needed for llama.cpp (or --stages ours)"),
    (["--peer-dir", "nowhere"], "peer kit nowhere is not a directory"),
    (["--plot-only", "none.json"], "--plot-only: no such file none.json"),
    (["--from-log", "none.log"], "--from-log: no such file none.log"),
    (["--plot-only", "a.json", "--from-log", "a.log"],
     "--plot-only and --from-log: pass one of them"),
])
def test_arguments_are_checked_before_any_work(module: Any, tmp_path: Path, argv: list[str],
                                               message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        module.parse_args(["--out", str(tmp_path / "o"), *argv])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_kit_without_the_gguf_tool_is_named(module: Any, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    kit = fake_kit(tmp_path)
    (kit / "make_gguf.py").unlink()
    with pytest.raises(SystemExit):
        module.parse_args(["--out", str(tmp_path), "--peer-dir", str(kit)])
    assert f"peer kit {kit} lacks make_gguf.py" in capsys.readouterr().err


def test_bench_prefill_modes_are_checked() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "bench_prefill.py"
    done = subprocess.run([sys.executable, str(script), "--modes", "auto,fast", "--out", "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--modes takes some of auto, gpu, split, cpu, got fast" in done.stderr
    assert parse_rows("") == []


def test_plot_only_names_a_file_that_is_not_json(module: Any, tmp_path: Path) -> None:
    bad = tmp_path / "cut.json"
    bad.write_text('{"formats": {"int4"')  # a copy cut short
    with pytest.raises(SystemExit, match=f"^--plot-only: {bad} is not JSON \\(Expecting"):
        module.main(["--plot-only", str(bad), "--out", str(tmp_path / "o")])


def test_the_figure_from_two_calls_printed_tables(module: Any, tmp_path: Path) -> None:
    """2026-11-27's INT4 and INT8 calls, whose JSON did not come back: the tables they printed
    read back into rows whose table is the printed one, line for line, and one PNG of both."""
    logs = [DATA / "prefill_vs_llamacpp_int4.log", DATA / "prefill_vs_llamacpp_int8.log"]
    for log in logs:
        text = log.read_text()
        printed = [line for line in text.splitlines()
                   if line.startswith("|") or line.startswith("INT")]
        assert [line for line in table(parse_log(text, log.name)).splitlines() if line] == printed
    int4 = parse_log(logs[0].read_text(), "int4.log")
    (call,) = int4["calls"]
    assert (call["date"], call["git"], call["machine"]["gpu"], call["source"]) == (
        "2026-11-27 16:08 UTC", "705b9be", "NVIDIA H100 80GB HBM3", "tables printed in int4.log")
    assert int4["formats"]["int4"]["ours"]["h2d_gb_s"] == 54.3
    p512, p1k, p4k, p16k = points(int4["formats"]["int4"])
    assert (p512["ours_tok_s"], p512["pcie_floor_tok_s"], p512["ours_gpu_experts"]) == (
        1371.0, 1394.0, 128)
    assert (p1k["llama_default_tok_s"], p1k["llama_best_tok_s"], p1k["llama_best_ubatch"]) == (
        1311.0, 2366.0, 1024)
    assert (p4k["over_best"], p4k["resident_tok_s"], p16k["resident_pass_s"]) == (
        1.87, 26754.0, 0.772)
    out = tmp_path / "fig"
    module.main(["--from-log", *map(str, logs), "--out", str(out)])
    assert sorted(os.listdir(out)) == OUT_FILES[:3]
    md = (out / "prefill_vs_llamacpp.md").read_text()
    assert md.count("against llama.cpp") == 2
    assert (f"Drawn from the tables printed in {logs[0]}; tables printed in {logs[1]} (their "
            "JSON was lost).") in md
    assert "| 16,384 | 21,489 (128) | 28,951 (74%) | 0.388 (42,227) | 0.744 | 794 | 4,978 " \
           "(16384) | **4.32x** | 27.07x |" in md
    assert (out / "prefill_vs_llamacpp.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(("text", "message"), [
    ("nothing here\n", "^x.log: no 'INTn against llama.cpp' table in it$"),
    ("INT3 against llama.cpp Q3_0 (H2D 5 GB/s, 1 GB of experts per pass):\n",
     "^x.log, line 1: format INT3: expected one of int4, int8$"),
    ("INT4 against llama.cpp Q4_0 (H2D 5 GB/s, 1 GB of experts per pass):\n| 512 | 1 | 2 |\n",
     "^x.log, line 2: 3 cells, the table has 9$"),
    ("INT4 against llama.cpp Q4_0 (H2D 5 GB/s, 1 GB of experts per pass):\n"
     "| 512 | fast | 1 | 1 | 1 | 1 | 1 (512) | 1.0x | 1.0x |\n",
     "^x.log, line 2: not a table cell of numbers: 'fast'$"),
])
def test_a_log_without_a_readable_table_is_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_log(text, "x.log")
