"""MoE GGUF files written by llama.cpp's own converter from baby HF models of every family: our
engine on the GGUF gives transformers' logits on the HF weights (F32: to rounding; Q8_0: within
8-bit quantization error), and every weight is the original, dequantized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from baby import assert_logits_close, reference_logits, reference_model

from hetmoe import LLM
from hetmoe.bench.llama_cpp import convert, converter_dir
from hetmoe.loading import Checkpoint
from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.gguf_checkpoint import write_checkpoint
from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.skipif(not (converter_dir() / "convert_hf_to_gguf.py").is_file(),
                       reason=f"llama.cpp's converter is not unpacked at {converter_dir()} "
                              "(.ci/run does it; or set HETMOE_LLAMA_CPP_SRC)"),
    pytest.mark.usefixtures("one_torch_thread"),
]
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2", "mixtral": "llama"}
IDS = [0, 7, 42, 99, 123, 200, 301, 17, 64, 88, 250, 400, 3, 511, 256, 128]


GgufOf = Callable[[str, str], Path]


@pytest.fixture(scope="module")
def gguf_of(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> GgufOf:
    """`gguf_of(family, outtype)`: the family's baby model through llama.cpp's converter, once
    per module (a converter run is seconds; three tests here read the same file); read-only."""
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, outtype: str) -> Path:
        if (family, outtype) not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{family}-{outtype}")
            made[family, outtype] = convert(tiny_dir(family), folder / "model.gguf", outtype)
        return made[family, outtype]

    return get


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_equal_transformers(family: str, outtype: str, tiny_dir, gguf_of: GgufOf,
                                        tmp_path: Path) -> None:
    source = tiny_dir(family)
    gguf = gguf_of(family, outtype)
    assert open_gguf(gguf).arch == ARCH[family]
    out = write_checkpoint(gguf, tmp_path / "checkpoint", progress=False)
    assert Checkpoint.open(out).family.model_type == family
    _assert_weights_close(_weights(out), _weights(source), exact=outtype == "f32")
    llm = LLM(out, device="cpu", dtype="float32", experts="torch", progress=False)
    ours, original = llm.logits(IDS), reference_logits(reference_model(source), IDS)  # [T, V]
    if outtype == "f32":
        assert_logits_close(ours, original, atol=1e-4)
        return
    # Q8_0: transformers on the same dequantized weights is the oracle; the original model's
    # top-1 stays mostly the same.
    assert_logits_close(ours, reference_logits(reference_model(out), IDS), atol=1e-4)
    assert (ours.argmax(-1) == original.argmax(-1)).float().mean() >= 0.75


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                          exact: bool) -> None:
    """Every HF tensor back from the GGUF: equal (F32), or within half a Q8_0 step of the original
    (step = absmax of its block of 32 along the row / 127, stored in fp16: 0.57 steps)."""
    # A tied lm_head is left out of the GGUF (and of what we write): transformers re-ties it.
    assert set(got) == set(want) - ({"lm_head.weight"} - set(got)), set(got) ^ set(want)
    for name, tensor in got.items():
        ref = want[name].float()
        if exact or tensor.dim() < 2 or torch.equal(tensor, ref):
            assert torch.equal(tensor, ref), name
            continue
        blocks = ref.reshape(-1, 32)
        bound = blocks.abs().amax(-1, keepdim=True) / 127 * 0.57 + 1e-7
        assert ((tensor.reshape(-1, 32) - blocks).abs() <= bound).all(), name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_llm_on_a_gguf_file_converts_once_then_maps(family: str, gguf_of: GgufOf, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """`LLM("model.gguf")`: converted into the cache dir on first use (Q8_0 experts -> int8 in
    32-groups, the same grid), mapped from there the next time; logits as transformers' on
    the GGUF's dequantized weights, within the CPU backend's int8 rounding."""
    gguf = gguf_of(family, "q8_0")
    monkeypatch.setenv("HETMOE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(gguf, device="cpu", dtype="float32", progress=False)
    assert "with int8 experts, group 32" in capfd.readouterr().err
    dequantized = write_checkpoint(gguf, tmp_path / "checkpoint", progress=False)
    want = reference_logits(reference_model(dequantized), IDS)
    ours = llm.logits(IDS)
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (ours - want).abs().max() < 0.1  # bf16 activations into the int8 CPU kernels
    converted = list((tmp_path / "cache" / "converted").iterdir())
    assert len(converted) == 1 and (converted[0] / "manifest.json").is_file()
    again = LLM(gguf, device="cpu", dtype="float32", progress=False)  # no second conversion
    assert "converting" not in capfd.readouterr().err
    torch.testing.assert_close(again.logits(IDS), ours)


def test_a_shared_expert_gate_without_its_unit_dim_reads_as_hf_shapes_it(
        tiny_dir, gguf_of: GgufOf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's quantizer writes Qwen2-MoE's ffn_gate_inp_shexp [H, 1] as [H]; the HF
    Linear(H, 1) weight is [1, H] either way."""
    from hetmoe.loading.gguf import GGUFFile

    gguf = gguf_of("qwen2_moe", "f32")
    read = GGUFFile.read

    def squeezed(self: GGUFFile, info: object) -> torch.Tensor:
        value = read(self, info)
        return value.reshape(-1) if "gate_inp_shexp" in info.name else value  # type: ignore[attr-defined]

    monkeypatch.setattr(GGUFFile, "read", squeezed)
    out = write_checkpoint(gguf, tmp_path / "checkpoint", progress=False)
    gate = _weights(out)["model.layers.0.mlp.shared_expert_gate.weight"]
    assert gate.shape == (1, 64)
    torch.testing.assert_close(gate, _weights(tiny_dir("qwen2_moe"))[
        "model.layers.0.mlp.shared_expert_gate.weight"])
    LLM(out, device="cpu", dtype="float32", experts="torch", progress=False)  # loads
