"""A converted model's start in its own process: resident memory after `LLM(OUT)` stays within
1.1 x packed bytes + non-expert bytes (the experts are mapped, not packed or copied), and a
conversion killed with SIGKILL finishes on a rerun with the files of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetmoe.loading.convert import ConvertOptions, convert
from hetmoe.loading.converted import MANIFEST

_RSS = """
import json, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
import torch, hetmoe.engine.engine
from hetmoe import LLM
# Modules LLM() imports on first use (config, modeling, tokenizer: over 100 MB) are in the
# baseline: the bound is about the experts' memory.
from transformers import AutoConfig, AutoTokenizer
import transformers.models.qwen3_moe.modeling_qwen3_moe
AutoConfig.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
before = rss()
llm = LLM(sys.argv[1], device='cpu', progress=False)
llm.logits([1, 2, 3])
print(json.dumps({'before': before, 'after': rss()}))
"""


@pytest.fixture(scope="module")
def big(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # 2 MoE layers of 64 experts, H = I = 512, bf16: 201 MB of packed experts.
    source = tiny_dir("qwen3_moe", dtype=torch.bfloat16, hidden_size=512,
                      moe_intermediate_size=512, num_experts=64)
    out = convert(source, tmp_path_factory.mktemp("big") / "out",
                  ConvertOptions("bf16", progress=False))
    return source, out


def test_rss_after_start_is_the_mapped_bytes(big: tuple[Path, Path]) -> None:
    _, out = big
    manifest = json.loads((out / MANIFEST).read_text())
    packed, weights = manifest["experts"]["packed_bytes"], manifest["weights_bytes"]
    assert packed > 200e6
    run = subprocess.run([sys.executable, "-c", _RSS, str(out)], capture_output=True, text=True,
                         check=True)
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    grown = rss["after"] - rss["before"]
    assert grown <= 1.1 * packed + weights, (grown, packed, weights)


def test_sigkilled_convert_finishes_on_rerun(big: tuple[Path, Path], tmp_path: Path) -> None:
    source, whole = big
    out = tmp_path / "out"
    script = ("import sys; from pathlib import Path; from hetmoe.loading.convert import "
              "ConvertOptions, convert; convert(Path(sys.argv[1]), Path(sys.argv[2]), "
              "ConvertOptions('bf16', progress=False))")
    proc = subprocess.Popen([sys.executable, "-c", script, str(source), str(out)])
    deadline = time.monotonic() + 120
    while not (out / ".convert-state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / MANIFEST).exists()
    convert(source, out, ConvertOptions("bf16", progress=False))
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert files == json.loads((whole / MANIFEST).read_text())["files"]
