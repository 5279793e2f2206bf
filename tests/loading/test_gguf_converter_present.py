"""CI unpacks llama.cpp's converter (.ci/run, which sets HETMOE_CI): there the MoE GGUF oracle
(test_gguf_moe.py) must run, not skip."""

from __future__ import annotations

import os

import pytest

from hetmoe.bench.llama_cpp import converter_dir


def test_the_converter_is_unpacked_where_ci_provides_it() -> None:
    present = (converter_dir() / "convert_hf_to_gguf.py").is_file()
    if os.environ.get("HETMOE_CI") and not present:
        pytest.fail(f"llama.cpp's converter is missing at {converter_dir()} in CI")
