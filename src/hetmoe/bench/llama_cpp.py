"""llama.cpp as a peer: the pinned llama-cpp-python sdist, its CPU-only build (`ensure_llama_cpp`)
and the sdist's own `convert_hf_to_gguf.py` (`convert`: HF checkpoint directories to GGUF files,
as users get them). The GGUF tests and benchmarks/peers/oracle_llamacpp.py both use it; nothing
here runs unless they call it (the sdist is fetched by tests/provision.py or `ensure_llama_cpp`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from hetmoe import env

VERSION = "0.3.36"
"""The pinned llama-cpp-python sdist (it vendors llama.cpp and its converter): the one `.ci/run`
(tests/provision.py) unpacks, `ensure_llama_cpp` builds, and benchmarks/peers/oracle_llamacpp.py
runs."""
CMAKE_ARGS = (
    "-DLLAVA_BUILD=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF "
    "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
    "-DLLAMA_BUILD_SERVER=OFF"
)
"""llama-cpp-python's CPU-only build (`ensure_llama_cpp`)."""

# Baby tokenizers are unknown to the converter's pre-tokenizer table: they take the GPT-2 label
# (the callers feed token ids, so the label only names a regex llama.cpp never runs here). Without
# llama-cpp-python's install dir (its sentencepiece) the llama vocab path cannot run either, so
# llama models take the plain GPT-2 path too.
_CONVERT = """
import sys
sys.path[0:0] = {path!r}
import conversion.base as base
import conversion.llama as llama
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
if {gpt2_vocab!r}:
    llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def converter_dir() -> Path:
    """The vendored llama.cpp tree: $HETMOE_LLAMA_CPP_SRC, else where `.ci/run` unpacks it."""
    given = os.environ.get("HETMOE_LLAMA_CPP_SRC")
    if given:
        return Path(given)
    return (env.cache_dir() / "oracle-llamacpp" / "src" / f"llama_cpp_python-{VERSION}" / "vendor"
            / "llama.cpp")


def convert(model_dir: Path, out: Path, outtype: str, llama: Path | None = None,
            site: Path | None = None) -> Path:
    """`outtype` (f32, f16, bf16, q8_0) GGUF of the HF checkpoint `model_dir` by the converter in
    `llama` (None: `converter_dir()`). `site`: llama-cpp-python's install dir
    (`ensure_llama_cpp`), whose sentencepiece lets llama models take the converter's own vocab
    path; None: they take the GPT-2 path (see `_CONVERT`)."""
    llama = converter_dir() if llama is None else llama
    path = [str(llama), str(llama / "gguf-py"), *([str(site)] if site is not None else [])]
    code = _CONVERT.format(path=path, gpt2_vocab=site is None, model=str(model_dir),
                           outtype=outtype, out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed on {model_dir}:\n{done.stderr[-4000:]}")
    return out


def _run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def ensure_llama_cpp(home: Path) -> tuple[Path, Path]:
    """Downloads, builds (once) and installs llama-cpp-python under `home`; returns the vendored
    llama.cpp source dir (for the converter) and the install dir, already on `sys.path`."""
    pip = [sys.executable, "-m", "pip"]
    sdist = home / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        _run(pip + ["download", "--no-deps", "--no-binary", ":all:", "-d", str(sdist.parent),
                    f"llama-cpp-python=={VERSION}"])
    src = home / "src"
    llama = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not llama.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    wheels = sorted((home / "wheels").glob(f"llama_cpp_python-{VERSION}-*.whl"))
    if not wheels:
        print("building llama-cpp-python (CPU only); this takes a while once", flush=True)
        build_env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS}
        _run(["nice", "-n", "10"] + pip + ["wheel", "--no-deps", "-w", str(home / "wheels"),
                                            str(sdist)], env=build_env)
        wheels = sorted((home / "wheels").glob(f"llama_cpp_python-{VERSION}-*.whl"))
    site = home / f"site-{VERSION}"
    if not (site / "llama_cpp").exists():
        # What hetmoe's env lacks: diskcache (llama_cpp) and sentencepiece (the llama converter
        # imports it before it looks for tokenizer.json).
        _run(pip + ["install", "--no-deps", "--target", str(site), str(wheels[-1]), "diskcache",
                    "sentencepiece"])
    sys.path.insert(0, str(site))
    return llama, site
