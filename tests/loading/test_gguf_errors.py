"""Bad MoE GGUF files are refused with the file and the field or tensor named (small files written
here with the gguf package's writer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetmoe.loading import CheckpointError
from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.gguf_checkpoint import write_checkpoint

gguf = pytest.importorskip("gguf")


def _write(path: Path, arch: str, fields: dict[str, int | float],
           tensors: dict[str, np.ndarray], raw: dict[str, tuple[np.ndarray, object]] | None = None
           ) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FIELDS: dict[str, int | float] = {
    "block_count": 1, "embedding_length": 64, "feed_forward_length": 96,
    "attention.head_count": 4, "context_length": 32, "attention.layer_norm_rms_epsilon": 1e-6,
    "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 48,
}
GLOBAL = {"token_embd.weight": np.zeros((16, 64), np.float32),
          "output_norm.weight": np.ones(64, np.float32)}


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "g.gguf", "gpt2", {}, {})
    with pytest.raises(CheckpointError, match=r"g\.gguf: general\.architecture is 'gpt2', "
                                              r"expected one of 'deepseek2', 'llama'"):
        open_gguf(path)


def test_a_dense_llama_is_not_a_moe_model(tmp_path: Path) -> None:
    fields = {k: v for k, v in FIELDS.items() if not k.startswith("expert")}
    path = _write(tmp_path / "d.gguf", "llama", fields, GLOBAL)
    with pytest.raises(CheckpointError, match=r"d\.gguf: a llama GGUF without field "
                                              r"'llama\.expert_count' is a dense model"):
        write_checkpoint(path, tmp_path / "out", progress=False)


def test_a_missing_field_is_named(tmp_path: Path) -> None:
    fields = {k: v for k, v in FIELDS.items() if k != "expert_feed_forward_length"}
    path = _write(tmp_path / "f.gguf", "qwen3moe", fields, GLOBAL)
    with pytest.raises(KeyError, match=r"f\.gguf: GGUF field "
                                       r"'qwen3moe\.expert_feed_forward_length' is missing"):
        write_checkpoint(path, tmp_path / "out", progress=False)


def test_a_missing_tensor_is_named_before_anything_is_written(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf", "qwen3moe", FIELDS, GLOBAL)
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'blk\.0\.attn_norm\.weight' is "
                                              r"missing \(qwen3moe, 1 layers\)"):
        write_checkpoint(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_quantization_type_gguf_cannot_dequantize_is_named(tmp_path: Path) -> None:
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    raw = {"blk.0.attn_q.weight": (np.zeros((64, 64 // block * size), np.uint8), q8_1)}
    path = _write(tmp_path / "q.gguf", "qwen3moe", FIELDS, GLOBAL, raw)
    g = open_gguf(path)
    with pytest.raises(CheckpointError, match=r"q\.gguf: tensor 'blk\.0\.attn_q\.weight' has "
                                              r"quantization type Q8_1, which the gguf package "
                                              r"cannot dequantize"):
        g.read(next(t for t in g.reader.tensors if t.name == "blk.0.attn_q.weight"))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q2_K", "Q4_0"])
def test_quantized_expert_stacks_read_back_in_hf_shape(tmp_path: Path, qtype: str) -> None:
    """A fused [E, out, in] stack of a block type is read as gguf dequantizes it, per expert."""
    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    # Bytes below 0x40: every fp16 scale in the blocks is finite.
    data = np.random.default_rng(0).integers(0, 64, (4, 48, 256 // block * size), np.uint8)
    path = _write(tmp_path / "k.gguf", "qwen3moe", FIELDS, GLOBAL,
                  {"blk.0.ffn_up_exps.weight": (data, kind)})
    g = open_gguf(path)
    info = next(t for t in g.reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    value = g.read(info)
    assert tuple(value.shape) == (4, 48, 256)
    want = gguf.quants.dequantize(data, kind)
    assert np.isfinite(want).all() and np.array_equal(value.numpy(), want)


def test_a_gguf_file_with_a_non_cpu_expert_backend_is_refused_before_converting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hetmoe import LLM

    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path / "cache"))
    path = _write(tmp_path / "m.gguf", "qwen3moe", FIELDS, GLOBAL)
    with pytest.raises(ValueError, match=r"m\.gguf: a GGUF file serves its routed experts from "
                                         r"the cpu backend's packed layout, not "
                                         r"experts='torch'"):
        LLM(path, device="cpu", experts="torch", progress=False)
    assert not (tmp_path / "cache" / "converted").exists()  # nothing converted


@pytest.mark.parametrize("command", ["generate", "info", "convert"])
def test_a_file_that_is_not_gguf_is_named_so(tmp_path: Path, command: str) -> None:
    from typer.testing import CliRunner

    from hetmoe.cli import app

    path = tmp_path / "junk.gguf"
    path.write_bytes(bytes(range(7, 71)))
    args = {"generate": [str(path), "hi"], "info": [str(path)],
            "convert": [str(path), str(tmp_path / "out")]}[command]
    result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 1
    assert result.output == (f"error: {path}: not a GGUF file (it starts with b'\\x07\\x08\\t\\n'"
                             ", a GGUF file with b'GGUF'); a model is a GGUF file, a checkpoint "
                             "directory or a preset\n")


def test_a_missing_gguf_file_is_named_so(tmp_path: Path) -> None:
    from hetmoe import LLM

    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path}/nope\.gguf: no such GGUF file$"):
        LLM(tmp_path / "nope.gguf", device="cpu", progress=False)


def test_a_truncated_file_names_the_tensor_and_its_bytes(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf", "qwen3moe", FIELDS, GLOBAL)
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # output_norm.weight, the last tensor: 256 bytes
    start = len(whole) - 256
    with pytest.raises(CheckpointError) as info:
        open_gguf(path)
    assert str(info.value) == (
        f"{path}: tensor 'output_norm.weight' needs 256 bytes at offset {start}, the file has "
        f"156 there (a file of {len(whole) - 100} bytes: cut short?)")
