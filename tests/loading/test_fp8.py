"""DeepSeek-V3 style FP8 block-scaled checkpoints: dequantized at load; errors name both tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetmoe.loading import Checkpoint, CheckpointError, load_model
from hetmoe.presets.tiny import FP8_BLOCK


def _reference_dequant(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Independent reference: every B×B block times its scale, via a Kronecker product."""
    rows, cols = weight.shape
    full = torch.kron(scale_inv.double(), torch.ones(FP8_BLOCK, FP8_BLOCK, dtype=torch.float64))
    return (weight.double() * full[:rows, :cols]).float()


def _stored(path):
    out = {}
    for file in path.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def test_fp8_weights_are_dequantized_exactly(tiny_dir):
    path = tiny_dir("deepseek_v3", fp8=True, sharded=True)
    stored = _stored(path)
    loaded = load_model(path, dtype=torch.float32, progress=False)
    params = dict(loaded.model.named_parameters())
    scaled = [n for n in stored if n.endswith("weight_scale_inv")]
    assert len(scaled) > 20
    for scale_name in scaled:
        name = scale_name.removesuffix("_scale_inv")
        expected = _reference_dequant(stored[name], stored[scale_name])
        if name in params:
            assert torch.equal(params[name], expected), name
        else:  # per-expert weight, stacked into the fused experts parameter
            prefix, expert, proj, _ = name.rsplit(".", 3)
            fused = params[prefix + (".down_proj" if proj == "down_proj" else ".gate_up_proj")]
            half = fused.shape[1] // 2
            rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None)}.get(proj)
            assert torch.equal(fused[int(expert), rows or slice(None)], expected), name
    assert "quantization_config" not in loaded.config.to_dict()


def test_fp8_model_matches_the_weights_it_was_built_from(tiny_dir):
    exact = load_model(tiny_dir("deepseek_v3"), dtype=torch.float32, progress=False).model
    fp8 = load_model(tiny_dir("deepseek_v3", fp8=True), dtype=torch.float32, progress=False).model
    scale_floor = 2.0**-9  # e4m3 subnormal step, relative to a block's largest value
    for name, original in exact.state_dict().items():
        got = fp8.state_dict()[name]
        # e4m3 keeps 3 mantissa bits: round-to-nearest errs by at most 2^-4 of the value.
        bound = original.abs() * 2.0**-4 + original.abs().max() * scale_floor
        assert ((got - original).abs() <= bound).all(), name


def test_fp8_model_defaults_to_bfloat16(tiny_dir):
    loaded = load_model(tiny_dir("deepseek_v3", fp8=True), progress=False)
    assert loaded.model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert loaded.model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_scale_shape_mismatch_names_both_tensors(tiny_dir, tmp_path):
    path = shutil.copytree(tiny_dir("deepseek_v3", fp8=True), tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.q_b_proj.weight"
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    message = str(err.value)
    assert f"{name!r}" in message and f"{name + '_scale_inv'!r}" in message
    assert "[1, 1]" in message and "need a scale of shape [6, 2]" in message


def test_fp8_without_scale_or_block_size_is_an_error(tiny_dir, tmp_path):
    path = shutil.copytree(tiny_dir("deepseek_v3", fp8=True), tmp_path / "noscale")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="up_proj.weight' is torch.float8_e4m3fn but has no"):
        Checkpoint.open(path)

    path = shutil.copytree(tiny_dir("deepseek_v3", fp8=True), tmp_path / "noconfig")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has no quantization_config with weight_block_size"):
        Checkpoint.open(path)
