"""The tiny presets: deterministic, shaped like real checkpoints, and loadable by transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from baby import reference_model
from safetensors import safe_open
from transformers import AutoTokenizer

from hetmoe.presets import presets, resolve_model
from hetmoe.presets.tiny import FAMILIES, FP8_BLOCK, build_tiny_model


def _tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_every_family_is_a_preset():
    names = set(presets())
    assert {"tiny-" + f.replace("_", "-") for f in FAMILIES} <= names


def test_readme_lists_every_preset():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    missing = [name for name in presets() if f"`{name}`" not in readme]
    assert not missing, f"README.md does not list the presets {missing}"


def test_first_build_says_what_it_builds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny-mixtral")
    assert f"building preset 'tiny-mixtral' into {path} (first use only)" in capsys.readouterr().err
    assert resolve_model("tiny-mixtral") == path
    assert capsys.readouterr().err == ""  # built once: later uses say nothing


def test_build_is_deterministic(tmp_path):
    a = _tensors(build_tiny_model("qwen3_moe", tmp_path / "a"))
    b = _tensors(build_tiny_model("qwen3_moe", tmp_path / "b"))
    c = _tensors(build_tiny_model("qwen3_moe", tmp_path / "c", seed=1))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_checkpoints_carry_real_family_traits(tiny_dir):
    keys = _tensors(tiny_dir("mixtral")).keys()
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys
    assert "model.layers.1.mlp.shared_expert_gate.weight" in _tensors(tiny_dir("qwen2_moe"))
    v3 = json.loads((tiny_dir("deepseek_v3") / "config.json").read_text())
    assert (v3["scoring_func"], v3["topk_method"]) == ("sigmoid", "noaux_tc")
    assert v3["n_group"] > 1 and v3["topk_group"] > 1 and v3["q_lora_rank"]
    assert v3["rope_parameters"]["rope_type"] == "yarn"
    bias = _tensors(tiny_dir("deepseek_v3"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0
    v2 = json.loads((tiny_dir("deepseek_v2") / "config.json").read_text())
    assert v2["first_k_dense_replace"] == 1 and v2["q_lora_rank"] is None
    assert v2["routed_scaling_factor"] != 1.0


def test_tokenizer_round_trips_and_has_chat_template(tiny_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_dir("qwen3_moe")))
    ids = tok("Hello, how are you?").input_ids
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1 and len(tok) == 512
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, how are you?"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_fp8_sharded_checkpoint_layout(tiny_dir):
    path = tiny_dir("deepseek_v3", fp8=True, sharded=True, mtp_layer=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [FP8_BLOCK, FP8_BLOCK]
    tensors = _tensors(path)
    assert set(index["weight_map"]) == set(tensors)
    weight = tensors["model.layers.1.self_attn.q_a_proj.weight"]
    scale = tensors["model.layers.1.self_attn.q_a_proj.weight_scale_inv"]
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (math.ceil(weight.shape[0] / FP8_BLOCK), weight.shape[1] // FP8_BLOCK)
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router stays
    assert "model.layers.3.eh_proj.weight" in tensors  # the MTP layer after the last


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_tiny_family(tiny_dir, family):
    model = reference_model(tiny_dir(family))
    tok = AutoTokenizer.from_pretrained(str(tiny_dir(family)))
    ids = torch.tensor([tok("The sea is wide").input_ids])
    probs = model(input_ids=ids).logits[0, -1].softmax(-1)
    assert probs.max() > 0.05  # peaked enough that greedy is not a near-tie
