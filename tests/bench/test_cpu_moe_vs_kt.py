"""benchmarks/peers/cpu_moe_vs_kt.py on the CPU: its argument checks, kt's rows read from a
stand-in ktk_bench.py (the real one is an AMX wheel for the device), the table, JSON and PNG
from canned rows, and a tiny end-to-end run of our layer (small shape, q = 1, 2)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
from bench_script import load_script

vs_kt = load_script("peers/cpu_moe_vs_kt.py")

FAKE_KT = textwrap.dedent('''
    """Stand-in ktk_bench.py: rows with known figures for every METHODS x QLENS it is given."""
    import json, os, sys, time
    if os.environ.get("FAIL"):
        print("kt: AMX not found"); sys.exit(3)
    if os.environ.get("HANG"):
        print("kt: packing"); time.sleep(30)
    env = {k: os.environ[k] for k in ("THREADS", "QLENS", "SHAPE", "LAYERS", "METHODS",
                                      "SKIP_TORCH")}
    rows = [{"impl": "torch-loop", "qlen": 1, "ms": 9.0, "tflops": 0.0, "weight_gbs": 1.0,
             "frac_stream": 0.1, "rel_err": 0.0}]
    for i, method in enumerate(env["METHODS"].split(",")):
        for q in map(int, env["QLENS"].split(",")):
            if f"{method}:{q}" == os.environ.get("DROP"):
                continue
            name = "kt-" + method.replace("_MOE", "")
            ms = (i + 1) * 0.1 * q
            print(f"   (per-call submit+sync latency {2 * ms:.3f} ms)")
            print(f"{name:14s} q={q:5d} {ms:9.3f} ms  1.00 TFLOPS")
            rows.append({"impl": name, "qlen": q, "ms": ms, "tflops": 0.5 * q,
                         "weight_gbs": 1.0, "frac_stream": 0.25, "rel_err": 0.01 * (i + 1)})
    with open(os.path.join(os.environ["OUT"], "ktk_bench.json"), "w") as f:
        json.dump({"machine": {}, "shape": [], "rows": rows, "env": env}, f)
''')


@pytest.fixture()
def peer_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "peers"
    folder.mkdir()
    (folder / "ktk_bench.py").write_text(FAKE_KT)
    return folder


def tiny_argv(peer_dir: Path, out: Path) -> list[str]:
    return ["--peer-dir", str(peer_dir), "--out", str(out), "--shape", "8,128,64,2", "--q",
            "1,2", "--layers", "2", "--threads", "2", "--bandwidth-gib", "0.01"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--q", "1,0"], "--q takes positive integers, got '0' in '1,0'"),
    (["--q", "2,2"], "--q lists a value twice: '2,2'"),
    (["--shape", "8,128,64"], "--shape takes E,H,I,K with K <= E, got '8,128,64'"),
    (["--shape", "4,128,64,8"], "--shape takes E,H,I,K with K <= E, got '4,128,64,8'"),
    (["--formats", "fp8"], "--formats takes bf16, int8, int4 (int8/int4 with :GROUP_SIZE), "
                           "got 'fp8'"),
    (["--formats", "bf16:32"], "--formats takes bf16, int8, int4 (int8/int4 with :GROUP_SIZE), "
                               "got 'bf16:32'"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--kt-timeout", "0"], "--kt-timeout must be > 0, got 0.0"),
    (["--warmup-s", "-1"], "--warmup-s must be >= 0, got -1.0"),
])
def test_bad_arguments_are_named(peer_dir: Path, tmp_path: Path, extra: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vs_kt.parse_args(tiny_argv(peer_dir, tmp_path / "out") + extra)
    assert capsys.readouterr().err.strip().endswith(message)
    assert not (tmp_path / "out").exists()  # refused before any work


def test_a_missing_peer_dir_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vs_kt.parse_args(["--peer-dir", str(tmp_path / "nope"), "--out", str(tmp_path)])
    assert capsys.readouterr().err.strip().endswith(
        f"--peer-dir {tmp_path / 'nope'}: no ktk_bench.py there (copy the peer kit first: "
        "cp -r ../shared/peers .peers, and carry .peers to the device)")


def test_kt_rows_take_latency_from_stdout_and_fail_without_it() -> None:
    result = {"rows": [{"impl": "torch-loop", "qlen": 1, "ms": 5.0},
                       {"impl": "kt-AMXInt8", "qlen": 2, "ms": 0.7, "tflops": 0.1,
                        "rel_err": 0.02, "frac_stream": 0.5}]}
    stdout = ("torch-loop     q=    1     5.000 ms\n"
              "   (per-call submit+sync latency 0.910 ms)\n"
              "kt-AMXInt8     q=    2     0.700 ms   0.10 TFLOPS\n")
    assert vs_kt.kt_rows(result, stdout) == {("int8", 2): {
        "ms": 0.7, "latency_ms": 0.91, "tflops": 0.1, "rel_err": 0.02, "frac_stream": 0.5}}
    with pytest.raises(ValueError, match=r"^ktk_bench.py: no latency line before its "
                                         r"kt-AMXInt8 q=2 row in its stdout$"):
        vs_kt.kt_rows(result, stdout.splitlines()[2])


def our_row(spec: str, q: int, ms: float) -> dict[str, Any]:
    return {"format": spec, "group_size": None, "q": q, "ms": ms, "latency_ms": 2 * ms,
            "rel_err": 0.003, "tflops": 4.0, "experts_touched": 8.0, "touched_bytes": 50e6}


def test_table_json_and_plot_from_canned_rows(tmp_path: Path) -> None:
    kt = {("bf16", 1): {"ms": 1.0, "latency_ms": 1.5, "tflops": 0.1, "rel_err": 0.004,
                        "frac_stream": 0.3},
          ("int4", 2048): {"ms": 12.0, "latency_ms": 12.5, "tflops": 4.1, "rel_err": 0.25,
                           "frac_stream": 0.9}}
    rows = vs_kt.combine([our_row("bf16", 1, 0.5), our_row("int4:32", 2048, 16.0)], kt, 100.0)
    assert rows[0]["bw_floor_ms"] == pytest.approx(0.5)  # 50 MB at 100 GB/s
    assert rows[0]["bw_fraction"] == pytest.approx(1.0)
    assert (rows[0]["ratio"], rows[0]["latency_ratio"]) == (2.0, 1.5)
    assert rows[1]["ratio"] == pytest.approx(0.75)
    assert rows[1]["kt_rel_err"] == 0.25
    lines = vs_kt.table(rows).splitlines()
    assert lines[1].split() == ["bf16", "1", "0.500", "1.000", "2.00", "1.000", "1.500", "1.50",
                                "0.0030", "0.0040", "100.0", "%", "of", "BW", "floor", "(0.500",
                                "ms)"]
    assert lines[2].split()[-2:] == ["4.00", "TOPS"]
    vs_kt.plot(rows, tmp_path / "p.png", "title")
    assert matplotlib.image.imread(tmp_path / "p.png").shape[:2] == (480, 840)
    with pytest.raises(ValueError, match=r"^ktk_bench.json has no AMXInt8_MOE row at q=1$"):
        vs_kt.combine([our_row("int8", 1, 0.5)], kt, 100.0)


def test_tiny_run_end_to_end(peer_dir: Path, tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    vs_kt.main([*tiny_argv(peer_dir, out), "--work", str(work)])
    # OUT holds four files, nothing nested (a device call returns a handful); kt wrote in work.
    assert sorted(p.name for p in out.iterdir()) == [
        "cpu_moe_vs_kt.json", "cpu_moe_vs_kt.png", "ktk_bench.json", "ktk_stdout.log"]
    assert (work / "ktk_bench.json").read_text() == (out / "ktk_bench.json").read_text()
    last = "kt-AMXInt4     q=    2     0.600 ms  1.00 TFLOPS\n"  # the stand-in's last line
    assert (out / "ktk_stdout.log").read_text().endswith(last)
    kt_json = json.loads((out / "ktk_bench.json").read_text())
    assert kt_json["env"] == {"THREADS": "2", "QLENS": "1,2", "SHAPE": "8,128,64,2",
                              "LAYERS": "2", "METHODS": "AMXBF16_MOE,AMXInt8_MOE,AMXInt4_MOE",
                              "SKIP_TORCH": "1"}
    report = json.loads((out / "cpu_moe_vs_kt.json").read_text())
    assert report["config"]["shape"] == [8, 128, 64, 2]
    rows = report["rows"]
    assert [(r["format"], r["q"]) for r in rows] == [
        (f, q) for f in ("bf16", "int8", "int4") for q in (1, 2)]
    bound = {"bf16": 1e-2, "int8": 2e-2, "int4": 0.15}  # the layer error bounds of issue 3
    for i, r in enumerate(rows):
        kt_ms = (i // 2 + 1) * 0.1 * r["q"]
        assert r["kt_ms"] == pytest.approx(kt_ms) and r["kt_latency_ms"] == pytest.approx(2 * kt_ms)
        assert r["ratio"] == pytest.approx(kt_ms / r["ms"])
        assert r["latency_ratio"] == pytest.approx(2 * kt_ms / r["latency_ms"])
        assert 0 < r["rel_err"] < bound[r["format"]]
        assert r["kt_rel_err"] == pytest.approx(0.01 * (i // 2 + 1))
        assert 1 <= r["experts_touched"] <= 2 * r["q"]
        assert r["tflops"] == pytest.approx(6 * 128 * 64 * 2 * r["q"] / r["ms"] / 1e9)
    assert report["bandwidth_gbs"]["bound"] == max(
        report["bandwidth_gbs"][k] for k in ("torch_sum", "pool_start", "pool_end"))
    assert matplotlib.image.imread(out / "cpu_moe_vs_kt.png").shape[:2] == (480, 840)


@pytest.mark.parametrize(("setting", "extra", "message", "log"), [
    (("FAIL", "1"), [], r"^ktk_bench.py: exit 3 \(log .*ktk_stdout.log\); its last lines:\n"
                        r"kt: AMX not found$", "kt: AMX not found\n"),
    (("HANG", "1"), ["--kt-timeout", "5"], r"^ktk_bench.py: timed out after 5 s \(log "
                                           r".*ktk_stdout.log\); its last lines:\nkt: packing$",
     "kt: packing\n"),
    (("DROP", "AMXInt4_MOE:2"), [], r"^.*out/ktk_bench.json lacks rows: AMXInt4_MOE q=2$",
     None),
])
def test_a_kt_run_without_every_row_ends_before_ours_named(
        peer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: tuple[str, str],
        extra: list[str], message: str, log: str | None) -> None:
    """kt's exit, its timeout (its output bytes then, what it printed kept) or missing rows."""
    monkeypatch.setenv(*setting)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=message):
        vs_kt.main(tiny_argv(peer_dir, out) + extra)
    assert not (out / "cpu_moe_vs_kt.json").exists()
    if log is not None:
        assert (out / "ktk_stdout.log").read_text() == log
