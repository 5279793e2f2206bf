"""An FP8 checkpoint's routed experts stay FP8 in the cpu backend (weight_format "fp8", the
default for FP8 checkpoints): a baby DeepSeek-V3 in e4m3 with 32x32 block scales gives the logits
of unmodified transformers on the dequantized weights, within bf16 activations' tolerance."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from baby import reference_logits, reference_model
from safetensors.torch import load_file, save_file

from hetmoe import LLM
from hetmoe.experts.cpu_backend import CpuExperts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK = 32


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every FP8 weight times its block scales (float32), no
    quantization_config: what transformers runs as the truth."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        out = {}
        for name, t in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            scale = tensors.get(name + "_scale_inv")
            if scale is not None:
                rows, cols = t.shape
                full = torch.kron(scale.double(), torch.ones(BLOCK, BLOCK, dtype=torch.float64))
                t = (t.double() * full[:rows, :cols]).float()
            out[name] = t
        save_file(out, file, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return dst


def _cpu_experts(llm: LLM) -> list[CpuExperts]:
    return [m for m in llm.model.modules() if isinstance(m, CpuExperts)]


def test_fp8_checkpoint_keeps_fp8_experts_and_matches_transformers(tiny_dir, tmp_path) -> None:
    path = tiny_dir("deepseek_v3", fp8=True, fp8_block=BLOCK)
    llm = LLM(path, device="cpu", dtype="float32", experts="cpu", progress=False)
    experts = _cpu_experts(llm)
    assert experts and all(e.moe.weight_format == "fp8" and e.moe.group_size == BLOCK
                           for e in experts)
    # One byte per weight plus a float per 16 rows x group (padding aside).
    spec = experts[0].spec
    weights = 3 * spec.num_experts * spec.hidden_size * spec.intermediate_size
    assert experts[0].moe.packed_bytes < weights * (1 + 4 / BLOCK) * 2.5
    ref = reference_model(_dequantized_copy(path, tmp_path / "dequantized"))
    prompt = llm.encode("The quick brown fox jumps over the lazy dog.")
    got, want = llm.logits(prompt), reference_logits(ref, prompt)
    # The experts compute on bf16 activations (as bf16 experts do): relative to the logits' scale.
    err = float((got - want).norm() / want.norm())
    assert err < 1e-2, err
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_rules_may_ask_for_dequantized_experts(tiny_dir, tmp_path) -> None:
    path = tiny_dir("deepseek_v3", fp8=True, fp8_block=BLOCK)
    rules = tmp_path / "rules.yaml"
    shipped = (Path(__file__).parents[2] / "src/hetmoe/rules/deepseek_v3.yaml").read_text()
    rules.write_text(shipped.replace("kwargs: {experts: auto}",
                                     "kwargs: {experts: auto, weight_format: bf16}"))
    llm = LLM(path, device="cpu", dtype="float32", experts="cpu", rules=rules, progress=False)
    assert {e.moe.weight_format for e in _cpu_experts(llm)} == {"bf16"}


def test_fp8_format_refuses_a_bf16_checkpoint_naming_the_tensor(tiny_dir, tmp_path) -> None:
    path = tiny_dir("deepseek_v3")
    rules = tmp_path / "rules.yaml"
    shipped = (Path(__file__).parents[2] / "src/hetmoe/rules/deepseek_v3.yaml").read_text()
    rules.write_text(shipped.replace("kwargs: {experts: auto}",
                                     "kwargs: {experts: auto, weight_format: fp8}"))
    with pytest.raises(ValueError, match=r"gate must be float8_e4m3fn .*weight_format='fp8'"):
        LLM(path, device="cpu", dtype="float32", experts="cpu", rules=rules, progress=False)


def test_blocks_narrower_than_a_group_fall_back_to_dequantized(tiny_dir) -> None:
    # The shipped tiny FP8 blocks are 16 columns: no fp8 group fits, experts are dequantized.
    llm = LLM(tiny_dir("deepseek_v3", fp8=True), device="cpu", dtype="float32", experts="cpu",
              progress=False)
    assert {e.moe.weight_format for e in _cpu_experts(llm)} == {"bf16"}
    assert math.isfinite(float(llm.logits(llm.encode("Hi"))[0, 0]))
