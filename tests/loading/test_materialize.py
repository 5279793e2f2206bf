"""load_model / materialize: equal to transformers' loading; owners; errors naming the problem."""

from __future__ import annotations

import shutil

import pytest
import torch
from baby import assert_same_state, reference_model
from safetensors.torch import load_file, save_file
from torch import nn

from hetmoe.loading import Checkpoint, CheckpointError, build_skeleton, load_model, materialize


def _rewrite(src, dst, edit):
    """A copy of checkpoint `src` whose single safetensors file went through `edit(tensors)`."""
    path = shutil.copytree(src, dst)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_every_family_loads_as_transformers_does(tiny_family):
    family, path = tiny_family
    loaded = load_model(path, dtype=torch.float32, progress=False)
    assert loaded.family == family
    assert not loaded.model.training
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == 1
    assert_same_state(loaded.model, reference_model(path))


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_bfloat16_checkpoint_loads_as_transformers_does(tiny_dir, family):
    path = tiny_dir(family, dtype=torch.bfloat16, sharded=True)
    loaded = load_model(path, progress=False)  # dtype from config.json
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert_same_state(loaded.model, reference_model(path, torch.bfloat16))


def test_float32_checkpoint_converts_to_bfloat16(tiny_dir):
    path = tiny_dir("qwen2_moe")
    loaded = load_model(path, dtype=torch.bfloat16, progress=False)
    assert_same_state(loaded.model, reference_model(path, torch.bfloat16))


def test_wrong_shape_names_tensor_file_expected_and_found(tiny_dir, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    path = _rewrite(
        tiny_dir("qwen3_moe"), tmp_path / "bad", lambda t: t.update({name: t[name][:, :32].clone()})
    )
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(err.value)
    assert f"tensor {name!r} in model.safetensors" in message
    assert "shape [64, 32]" in message and "expects [64, 64]" in message


def test_wrong_expert_shape_names_the_stored_name(tiny_dir, tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    path = _rewrite(
        tiny_dir("mixtral"), tmp_path / "bad", lambda t: t.update({name: t[name][:8].clone()})
    )
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(err.value)
    assert "'model.layers.0.mlp.experts.2.up_proj.weight'" in message
    assert f"(stored as {name!r})" in message
    assert "shape [8, 64]" in message and "gate_up_proj[2]" in message and "[96, 64]" in message


def test_integer_tensor_where_float_expected(tiny_dir, tmp_path):
    name = "model.norm.weight"
    path = _rewrite(
        tiny_dir("qwen3_moe"), tmp_path / "bad", lambda t: t.update({name: t[name].to(torch.int32)})
    )
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(err.value)
    assert f"tensor {name!r} in model.safetensors: dtype torch.int32" in message
    assert "expects a floating-point dtype (torch.float32)" in message


def test_missing_tensors_are_listed_with_a_count(tiny_dir, tmp_path):
    def drop(tensors):
        for name in [n for n in tensors if ".q_norm." in n or n == "lm_head.weight"]:
            del tensors[name]

    path = _rewrite(tiny_dir("qwen3_moe"), tmp_path / "bad", drop)
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(err.value)
    assert "lacks 3 tensors the model needs" in message
    assert "'lm_head.weight'" in message and "'model.layers.1.self_attn.q_norm.weight'" in message


def test_missing_expert_of_a_fused_stack_is_named(tiny_dir, tmp_path):
    gone = "model.layers.1.mlp.experts.6.down_proj.weight"
    path = _rewrite(tiny_dir("qwen3_moe"), tmp_path / "bad", lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=f"lacks 1 tensors the model needs: '{gone}'"):
        load_model(path, dtype=torch.float32, progress=False)


def test_tensor_without_a_place_in_the_model(tiny_dir, tmp_path):
    extra = {f"model.layers.0.mlp.extra{i}.weight": torch.ones(2) for i in range(7)}
    path = _rewrite(tiny_dir("qwen3_moe"), tmp_path / "bad", lambda t: t.update(extra))
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype=torch.float32, progress=False)
    message = str(err.value)
    assert "7 checkpoint tensors have no place in the Qwen3MoeForCausalLM" in message
    assert "'model.layers.0.mlp.extra0.weight'" in message and "and 2 more" in message


class _Recorder(nn.Module):
    """Stands where injection would put an expert backend: takes its tensors by name."""

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.received: dict[str, torch.Tensor] = {}

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self.received, f"{name} streamed twice"
        self.received[name] = tensor


def test_load_tensor_owners_receive_their_tensors_once(tiny_dir):
    path = tiny_dir("mixtral")
    stored = load_file(path / "model.safetensors")

    def inject(model: nn.Module) -> list[str]:
        replaced = []
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts = _Recorder()
            replaced.append(f"model.layers.{i}.mlp.experts")
        return replaced

    loaded = load_model(path, dtype=torch.bfloat16, inject=inject, progress=False)
    assert loaded.inject_report == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    received = loaded.model.model.layers[1].mlp.experts.received
    assert len(received) == 8 * 3
    got = received["5.gate_proj.weight"]
    assert got.dtype == torch.bfloat16 and got.device.type == "cpu"
    want = stored["model.layers.1.block_sparse_moe.experts.5.w1.weight"].to(torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(
        received["5.down_proj.weight"],
        stored["model.layers.1.block_sparse_moe.experts.5.w2.weight"].to(torch.bfloat16),
    )
    router = loaded.model.model.layers[1].mlp.gate.weight  # outside the owner: a plain parameter
    assert router.device.type == "cpu" and router.dtype == torch.bfloat16


def test_skeleton_is_on_meta_and_progress_is_quiet_off_a_terminal(tiny_dir, capfd):
    checkpoint = Checkpoint.open(tiny_dir("deepseek_v2"))
    model = build_skeleton(checkpoint.config, torch.float32)
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}
    materialize(model, checkpoint, device="cpu", dtype=torch.float32, progress=True)
    assert capfd.readouterr().err == ""  # stderr is not a TTY under pytest
    assert {t.device.type for t in model.state_dict().values()} == {"cpu"}
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.device.type == "cpu" and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0


def test_tied_embeddings_stay_tied(tiny_dir):
    path = tiny_dir("qwen3_moe", tie_word_embeddings=True)
    loaded = load_model(path, dtype=torch.float32, progress=False)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert_same_state(loaded.model, reference_model(path))
