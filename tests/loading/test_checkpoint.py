"""Checkpoint.open: config and family checks, single vs sharded files, renames, skips, errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetmoe.loading import Checkpoint, CheckpointError
from hetmoe.loading.families import FAMILIES


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_json(path, **fields):
    data = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_single_and_sharded_hold_the_same_tensors(tiny_dir):
    single = Checkpoint.open(tiny_dir("qwen3_moe"))
    sharded = Checkpoint.open(tiny_dir("qwen3_moe", sharded=True))
    files = {t.entry.file.name for t in sharded.tensors.values()}
    assert len(files) >= 2
    assert single.tensors.keys() == sharded.tensors.keys()
    for name, item in single.tensors.items():
        assert torch.equal(single.tensor(item), sharded.tensor(sharded.tensors[name])), name


def test_tensor_data_matches_safetensors(tiny_dir):
    path = tiny_dir("qwen2_moe")
    stored = load_file(path / "model.safetensors")
    checkpoint = Checkpoint.open(path)
    assert checkpoint.tensors.keys() == stored.keys()
    for name, item in checkpoint.tensors.items():
        assert torch.equal(checkpoint.tensor(item), stored[name]), name
    assert checkpoint.tensor(checkpoint.tensors["lm_head.weight"], torch.bfloat16).dtype == (
        torch.bfloat16
    )


def test_mixtral_names_are_renamed_into_module_space(tiny_dir):
    checkpoint = Checkpoint.open(tiny_dir("mixtral"))
    item = checkpoint.tensors["model.layers.1.mlp.experts.5.gate_proj.weight"]
    assert item.entry.name == "model.layers.1.block_sparse_moe.experts.5.w1.weight"
    assert checkpoint.tensors["model.layers.0.mlp.experts.0.up_proj.weight"].entry.name.endswith(
        "experts.0.w3.weight"
    )
    assert checkpoint.tensors["model.layers.0.mlp.experts.0.down_proj.weight"].entry.name.endswith(
        "experts.0.w2.weight"
    )
    assert "model.layers.0.mlp.gate.weight" in checkpoint.tensors
    assert not any("block_sparse_moe" in name for name in checkpoint.tensors)


def test_deepseek_router_fields_are_kept_or_filled(tiny_dir, tmp_path):
    v3 = Checkpoint.open(tiny_dir("deepseek_v3")).config
    assert (v3.scoring_func, v3.topk_method) == ("sigmoid", "noaux_tc")
    bare = _copy(tiny_dir("deepseek_v3"), tmp_path / "v3")
    _edit_json(bare / "config.json", scoring_func=None, topk_method=None)
    filled = Checkpoint.open(bare).config
    assert (filled.scoring_func, filled.topk_method) == ("sigmoid", "noaux_tc")
    v2 = Checkpoint.open(tiny_dir("deepseek_v2")).config
    assert (v2.scoring_func, v2.topk_method) == ("softmax", "group_limited_greedy")


def test_mtp_layer_and_inv_freq_are_skipped(tiny_dir, tmp_path, caplog):
    path = _copy(tiny_dir("deepseek_v3", mtp_layer=True), tmp_path / "v3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.DEBUG, logger="hetmoe.loading"):
        checkpoint = Checkpoint.open(path)
    assert not any(n.startswith("model.layers.3.") or "inv_freq" in n for n in checkpoint.tensors)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in checkpoint.tensors
    assert "skipping model.layers.3.eh_proj.weight" in caplog.text
    assert "skipping model.layers.0.self_attn.rotary_emb.inv_freq" in caplog.text


def test_unsupported_model_type_lists_the_supported(tiny_dir, tmp_path):
    path = _copy(tiny_dir("qwen3_moe"), tmp_path / "llama")
    _edit_json(path / "config.json", model_type="llama")
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    message = str(err.value)
    assert "model_type 'llama' is not supported" in message and "config.json" in message
    assert all(family in message for family in FAMILIES)


def test_missing_config_and_missing_weights(tmp_path, tiny_dir):
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint.open(tmp_path)
    path = _copy(tiny_dir("qwen3_moe"), tmp_path / "empty")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        Checkpoint.open(path)


def test_missing_shard_names_shard_and_index(tiny_dir, tmp_path):
    path = _copy(tiny_dir("mixtral", sharded=True), tmp_path / "sharded")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        Checkpoint.open(path)
    assert f"shard {shard.name!r}" in str(err.value)
    assert "model.safetensors.index.json" in str(err.value) and "does not exist" in str(err.value)


def test_index_pointing_at_the_wrong_shard(tiny_dir, tmp_path):
    path = _copy(tiny_dir("mixtral", sharded=True), tmp_path / "sharded")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"maps '{name}' to shard '{files[1]}'"):
        Checkpoint.open(path)


def test_truncated_file_is_reported(tiny_dir, tmp_path):
    path = _copy(tiny_dir("qwen3_moe"), tmp_path / "cut")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* spans bytes"):
        Checkpoint.open(path)
