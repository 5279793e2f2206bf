"""llama.cpp's own `convert_hf_to_gguf.py`, from the llama-cpp-python sdist that `.ci/run` unpacks
(never committed here): HF checkpoint directories to GGUF files, as users get them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hetmoe import env

VERSION = "0.3.36"
"""The llama-cpp-python sdist `.ci/run` unpacks (benchmarks/peers/oracle_llamacpp.py pins the
same)."""

# Baby tokenizers are unknown to the converter's pre-tokenizer table and the llama vocab path
# needs sentencepiece: the tests feed token ids, so both take the plain GPT-2 path.
_CONVERT = """
import sys
sys.path[0:0] = [{llama!r}, {gguf_py!r}]
import conversion.base as base
import conversion.llama as llama
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
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


def convert(model_dir: Path, out: Path, outtype: str) -> Path:
    """`outtype` (f32, f16, bf16, q8_0) GGUF of the HF checkpoint `model_dir`."""
    llama = converter_dir()
    code = _CONVERT.format(llama=str(llama), gguf_py=str(llama / "gguf-py"),
                           model=str(model_dir), outtype=outtype, out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed on {model_dir}:\n{done.stderr[-4000:]}")
    return out
