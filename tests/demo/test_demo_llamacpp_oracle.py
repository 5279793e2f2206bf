"""llama.cpp as the outside oracle (opt-in: `pytest -m oracle`). Runs the benchmark script, which
builds llama-cpp-python once into the cache (an hour on 2 cores the first time), on a baby of every
family and on `demo` when its wheel is installed; our fp32 engine must agree token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "oracle_llamacpp.py"
TOKENS = 64


@pytest.mark.oracle
def test_llama_cpp_agrees_with_our_fp32_engine(tmp_path):
    out = tmp_path / "oracle.json"
    cmd = [sys.executable, str(SCRIPT), "--tokens", str(TOKENS), "--experts", "torch",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    families = {r["model"].split(" ")[0] for r in rows}
    assert families >= {
        "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-mixtral"
    }
    for r in rows:
        assert r["top1_agree"] == r["continuation"] == TOKENS, r
        assert r["greedy_shared"] == r["greedy_len"], r
        assert r["max_abs_dlogit"] <= 1e-3, r
