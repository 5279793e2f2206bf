"""benchmarks/serving/batch_peer.sh with a stand-in llama-batched-bench (a warm machine: the
build and the GGUF already there): a list of -npl values sizes the context for the largest, READY
is touched before the timed run and the run waits for AFTER, and its table is saved where
bench_serve.py --plot --peer reads it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from hetmoe.bench.batched_bench import parse_batched_bench

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving" / "batch_peer.sh"

FAKE_BENCH = """#!{python}
# Stands in for llama-batched-bench: its argv saved, one table row per -npl value.
import sys
from pathlib import Path
Path({argv!r}).write_text(" ".join(sys.argv[1:]))
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
pp, tg = int(a["-npp"]), int(a["-ntg"])
print("|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |" % ("PP", "TG", "B", "N_KV",
      "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"))
for pl in map(int, a["-npl"].split(",")):
    print("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |"
          % (pp, tg, pl, pl * (pp + tg), 0.1, pl * pp / 0.1, 1.0, pl * tg, 1.1, 0.0))
"""


def kit(tmp: Path) -> tuple[Path, Path]:
    """A peer kit with the source tar's GGUF-writer paths, and a built llama.cpp tree."""
    src = tmp / "src" / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    (src / "models").mkdir()
    (src / "models" / "ggml-vocab-qwen2.gguf").write_bytes(b"GGUF")
    (tmp / "peers" / "lcpp").mkdir(parents=True)
    with tarfile.open(tmp / "peers" / "lcpp" / "src.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="llama.cpp")
    bin_dir = tmp / "dest" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (tmp / "dest" / "build" / "env.sh").write_text("")
    fake = bin_dir / "llama-batched-bench"
    fake.write_text(FAKE_BENCH.format(python=sys.executable, argv=str(tmp / "argv.txt")))
    os.chmod(fake, 0o755)
    return tmp / "peers", tmp / "dest"


def test_waits_for_after_and_runs_the_npl_list(tmp_path: Path) -> None:
    peers, dest = kit(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    ready, after, out = tmp_path / "ready", tmp_path / "ours.done", tmp_path / "out"
    env = os.environ | {"PEERS": str(peers), "DEST": str(dest), "GGUF": str(gguf),
                        "OUT": str(out), "READY": str(ready), "AFTER": str(after),
                        "NPL": "1,2,4", "NPP": "32", "NTG": "48", "DEADLINE": "60"}
    run = subprocess.Popen(["bash", str(SCRIPT)], env=env, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(200):
        if ready.exists():
            break
        time.sleep(0.05)
    assert ready.exists()
    time.sleep(0.5)
    assert not (tmp_path / "argv.txt").exists()  # held until AFTER exists
    after.touch()
    stdout, _ = run.communicate(timeout=60)
    assert run.returncode == 0, stdout
    argv = (tmp_path / "argv.txt").read_text().split()
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert (flags["-npl"], flags["-c"], flags["-npp"], flags["-ntg"]) == ("1,2,4", "320", "32",
                                                                         "48")
    assert flags["-ot"] == "exps=CPU" and flags["-m"] == str(gguf)
    rows = parse_batched_bench((out / "batched_bench.md").read_text())
    assert [(r["pl"], r["speed_tg"]) for r in rows] == [(1, 48.0), (2, 96.0), (4, 192.0)]
    assert "already built (a warm machine)" in stdout and f"reusing {gguf}" in stdout


def test_ready_is_touched_when_it_fails(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env = os.environ | {"PEERS": str(tmp_path / "none"), "READY": str(ready),
                        "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and ready.exists()
    assert f"no {tmp_path / 'none'}/lcpp/src.tar.gz: carry .peers" in done.stdout
