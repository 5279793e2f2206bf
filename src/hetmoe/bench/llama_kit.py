"""The peer kit's llama.cpp on the device machine: its prebuilt `llama-bench` unpacked and its
random Qwen3-30B-A3B GGUF written (`../shared/peers/README.md`; carried as `.peers`).

The kit is run, never copied: `lcpp/prebuilt.tar.xz` (a static llama-bench for sm_90 and
Sapphire Rapids), `lcpp/src.tar.gz` (its gguf-py and the Qwen2 vocab, which `make_gguf.py`
needs) and `make_gguf.py`. Used by benchmarks/engine/gpu_experts_sweep.py and
benchmarks/peers/prefill_vs_llamacpp.py; a subprocess past its time is cut (`run`), what it
wrote stays.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

SAP_RAPIDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi",
              "avx_vnni", "f16c", "fma", "bmi2")
"""CPU flags the prebuilt llama-bench needs (peer kit: ggml's sapphirerapids level)."""

KIT_FILES = ("lcpp/prebuilt.tar.xz", "lcpp/src.tar.gz", "make_gguf.py")
"""What the kit must hold: the binary, the GGUF tool's gguf-py and vocab, the GGUF tool."""

BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_0": 18 / 32, "bf16": 2.0}
"""GGUF block bytes per weight (Q8_0: fp16 scale + 32 int8; Q4_0: fp16 scale + 32 nibbles)."""

EXPERT_WEIGHTS_PER_LAYER = 3 * 128 * 2048 * 768
"""Routed expert weights of one Qwen3-30B-A3B layer (gate, up and down of 128 experts)."""


def check_kit(peer_dir: Path) -> None:
    """Raises FileNotFoundError naming the peer dir or the first of `KIT_FILES` it lacks."""
    if not peer_dir.is_dir():
        raise FileNotFoundError(f"peer kit {peer_dir} is not a directory (copy ../shared/peers "
                                "into .peers and carry it: ../shared/peers/README.md)")
    for name in KIT_FILES:
        if not (peer_dir / name).is_file():
            raise FileNotFoundError(f"peer kit {peer_dir} lacks {name} (the GGUF tool and "
                                    "llama-bench come from ../shared/peers)")


def run(cmd: list[str], log: Path, timeout: float, stdout: Path | None = None,
        env: dict[str, str] | None = None) -> str:
    """Runs `cmd` (stderr, and stdout unless `stdout`, into `log`); at `timeout` seconds it gets
    SIGINT, then SIGKILL: what it wrote stays. Returns "ok", "timed out" or "exit N"."""
    print(f"+ {' '.join(cmd)}   ({timeout:.0f} s)", flush=True)
    with open(log, "w") as err, open(stdout or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out if stdout else err,
                                stderr=err if stdout else subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop(proc)
            return "timed out"
    return "ok" if code == 0 else f"exit {code}"


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGINT (llama-bench and Python write what they have), SIGKILL after 10 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cuda_lib_dirs() -> list[str]:
    """Where libcudart / libcublas 13 are: pip's nvidia wheels (PyTorch's), then the toolkit."""
    dirs = []
    for name in ("nvidia.cu13", "nvidia.cublas", "nvidia.cuda_runtime"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for path in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.join(path, "lib"))
    return [*dirs, "/usr/local/cuda/lib64"]


def unpack_llama_bench(peer_dir: Path, work: Path) -> tuple[Path, dict[str, str]]:
    """The kit's prebuilt llama-bench unpacked under `work/bin`, and the environment it runs in
    (its CUDA libraries found). RuntimeError where this CPU lacks its ISA (it would die with
    SIGILL)."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    missing = [f for f in SAP_RAPIDS if f not in flags]
    if missing:
        raise RuntimeError(f"the prebuilt llama-bench needs {', '.join(missing)} (a Sapphire "
                           "Rapids or newer CPU); this CPU lacks them")
    (work / "bin").mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xJf", str(peer_dir / "lcpp" / "prebuilt.tar.xz"), "-C",
                    str(work / "bin")], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(
        [str(work / "bin"), *cuda_lib_dirs(), os.environ.get("LD_LIBRARY_PATH", "")]))
    return work / "bin" / "llama-bench", env


def gguf_bytes(expert_type: str, layers: int = 48) -> int:
    """About the bytes of the kit's GGUF: experts of `expert_type` plus 4 GB for attention,
    embeddings (Q8_0 at most) and room."""
    if expert_type not in BYTES_PER_WEIGHT:
        raise ValueError(f"GGUF expert type {expert_type!r}: expected one of "
                         f"{', '.join(BYTES_PER_WEIGHT)}")
    return int(layers * EXPERT_WEIGHTS_PER_LAYER * BYTES_PER_WEIGHT[expert_type]) + 4 * 10**9


def write_gguf(peer_dir: Path, work: Path, expert_type: str, dense_type: str, log: Path,
               timeout: float, layers: int = 48) -> Path:
    """The kit's random Qwen3-30B-A3B GGUF (`make_gguf.py --type expert_type --dense-type
    dense_type`, every core) in /dev/shm when it has room, else /tmp. RuntimeError naming the log
    when make_gguf.py fails or passes `timeout`."""
    need = gguf_bytes(expert_type, layers)
    subprocess.run(["tar", "-xzf", str(peer_dir / "lcpp" / "src.tar.gz"), "-C", str(work),
                    "llama.cpp/gguf-py", "llama.cpp/models/ggml-vocab-qwen2.gguf"], check=True)
    shm = Path("/dev/shm")
    where = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else Path("/tmp")
    gguf = where / f"peer_qwen3_{layers}L_{expert_type}_{dense_type}.gguf"
    status = run([sys.executable, str(peer_dir / "make_gguf.py"), "--llama-cpp",
                  str(work / "llama.cpp"), "--layers", str(layers), "--type", expert_type,
                  "--dense-type", dense_type, "--threads", str(os.cpu_count() or 8),
                  "-o", str(gguf)], log, timeout)
    if status != "ok":
        gguf.unlink(missing_ok=True)
        raise RuntimeError(f"make_gguf.py {status}: see {log}")
    return gguf
