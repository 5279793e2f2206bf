"""The llama GGUF reader against transformers' own GGUF loader (an implementation nobody here
wrote), plus its error messages on small hand-written GGUF files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hetmoe.loading.gguf import open_gguf

pytest.importorskip("gguf", reason="the GGUF reader needs the gguf package: pip install gguf")


def test_tensors_equal_transformers_gguf_loader(smollm2, dense):
    mine = dict(smollm2.llama_tensors())
    ref = dense.state_dict()
    # SmolLM2 ties lm_head to the embeddings: the GGUF has no `output` tensor.
    assert dense.config.tie_word_embeddings
    assert set(mine) == set(ref) - {"lm_head.weight"}
    for name, tensor in mine.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), f"{name} differs from transformers' dequantization"


def test_llama_config_matches_transformers(smollm2, dense):
    config = smollm2.llama_config()
    ref = dense.config
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "bos_token_id", "eos_token_id",
    ):
        assert config[field] == getattr(ref, field), field
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)


def test_tokenizer_gives_the_ids_of_transformers_gguf_tokenizer(smollm2):
    tok = smollm2.tokenizer()
    # Expected ids as transformers' GGUF tokenizer produces them for the same file.
    cases = {
        "Hello world, it's 2024!": [19556, 905, 28, 357, 506, 216, 34, 32, 34, 36, 17],
        "<|im_start|>user\nWhat is 12345+6?<|im_end|>\n": [
            1, 4093, 198, 1780, 314, 216, 33, 34, 35, 36, 37, 27, 38, 47, 2, 198,
        ],
    }
    for text, ids in cases.items():
        assert tok.encode(text).ids == ids, text
    odd = "  Spaces,\ttabs\n\nand ünïcödé — 日本語!"
    assert tok.decode(tok.encode(odd).ids) == odd


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], **fields: object) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        key = key.replace("__", ".")
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_llama_fields(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "llama__block_count": 1, "llama__embedding_length": 8, "llama__feed_forward_length": 16,
        "llama__attention__head_count": 2, "llama__context_length": 32,
        "llama__attention__layer_norm_rms_epsilon": 1, "tokenizer__ggml__model": "gpt2",
        "tokenizer__ggml__pre": "smollm", "tokenizer__ggml__tokens": ["a", "b"],
        "tokenizer__ggml__bos_token_id": 0, "tokenizer__ggml__eos_token_id": 1,
    }
    fields.update(overrides)
    return fields


def test_other_architectures_are_refused(tmp_path):
    path = _write_gguf(tmp_path / "q.gguf", "qwen2", {})
    with pytest.raises(ValueError, match=r"q\.gguf: general\.architecture is 'qwen2', expected"):
        open_gguf(path)


def test_unknown_tensor_names_are_refused(tmp_path):
    tensors = {"blk.0.ffn_gate_exps.weight": np.zeros((16, 8), np.float32)}
    path = _write_gguf(tmp_path / "m.gguf", "llama", tensors, **_tiny_llama_fields())
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has no HF name"):
        list(open_gguf(path).llama_tensors())


def test_missing_fields_and_unsupported_tokenizers_are_named(tmp_path):
    fields = _tiny_llama_fields(tokenizer__ggml__pre="llama-bpe")
    del fields["llama__context_length"]
    model = open_gguf(_write_gguf(tmp_path / "t.gguf", "llama", {}, **fields))
    with pytest.raises(KeyError, match=r"GGUF field 'llama\.context_length' is missing"):
        model.llama_config()
    with pytest.raises(ValueError, match=r"tokenizer 'gpt2' with pre-tokenizer 'llama-bpe' is not"):
        model.tokenizer()
