"""The `cpu` expert backend (C++ kernels) against the torch backend, layer by layer and whole
models: equal within bf16 tolerance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hetmoe import LLM
from hetmoe.experts.backend import ExpertSpec
from hetmoe.experts.cpu_backend import CpuExperts
from hetmoe.experts.torch_backend import TorchExperts
from hetmoe.inject.rules import parse_rules
from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.skipif(
        CpuExperts.unavailable() is not None, reason=f"cpu backend: {CpuExperts.unavailable()}"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]
SPEC = ExpertSpec(num_experts=6, hidden_size=64, intermediate_size=96)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


def test_layer_matches_torch_backend_in_every_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    cpu = CpuExperts(SPEC, torch.device("cpu"), torch.float32)
    ref = TorchExperts(SPEC, torch.device("cpu"), torch.float32)
    h, i = SPEC.hidden_size, SPEC.intermediate_size
    for e in range(SPEC.num_experts):
        # bf16-exact weights: the only difference left is the kernels' arithmetic.
        gate, up = (torch.randn(i, h, generator=gen).bfloat16() for _ in range(2))
        down = torch.randn(h, i, generator=gen).bfloat16()
        for backend in (cpu, ref):
            backend.load_tensor(f"{e}.gate_proj.weight", gate)
            backend.load_tensor(f"{e}.up_proj.weight", up)
            backend.load_tensor(f"{e}.down_proj.weight", down)
    assert cpu.missing() == []
    x = torch.randn(9, h, generator=gen)
    ids = torch.randint(-1, SPEC.num_experts, (9, 3), generator=gen)
    weights = torch.rand(9, 3, generator=gen)
    expected = ref(x, ids, weights)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = cpu(x.to(dtype), ids, weights)
        assert out.dtype == dtype and out.shape == x.shape
        assert rel_error(out, expected) < 1e-2, dtype
    cpu.submit(x, ids, weights)
    assert torch.equal(cpu.sync(), cpu(x, ids, weights))
    with pytest.raises(RuntimeError, match="sync called without submit"):
        cpu.sync()


def test_rule_kwargs_choose_backend_and_format(tiny_dir: Callable[..., Path], tmp_path) -> None:
    rules = tmp_path / "int8.yaml"
    rules.write_text(
        "- match: {class: Qwen3MoeAttention}\n  replace: {op: static_kv_attention}\n"
        "- match: {class: Qwen3MoeSparseMoeBlock}\n"
        "  replace: {op: hybrid_moe, kwargs: {experts: cpu, weight_format: int8}}\n"
    )
    llm = LLM(tiny_dir("qwen3_moe"), device="cpu", rules=rules, progress=False)
    experts = llm.model.model.layers[0].mlp.experts
    assert isinstance(experts, CpuExperts) and experts.moe.weight_format == "int8"
    with pytest.raises(ValueError,
                       match="weight_format must be bf16, int8, int4 or fp8, got 'fp4'"):
        parse_rules("- match: {class: X}\n  replace: {op: hybrid_moe, "
                    "kwargs: {weight_format: fp4}}\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_cpu_vs_torch(family: str, tiny_dir: Callable[..., Path]) -> None:
    path = tiny_dir(family, dtype=torch.bfloat16)
    cpu = LLM(path, device="cpu", dtype="float32", progress=False)  # shipped rules: auto
    ref = LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)
    assert type(cpu.model.model.layers[-1].mlp.experts) is CpuExperts  # auto picks the kernels
    ids = ref.encode("The quick brown fox jumps over the lazy dog. Hello there, harbour town!")
    ours, expected = cpu.logits(ids), ref.logits(ids)  # [T, V]
    per_position = (ours - expected).abs().amax(dim=-1)  # [T]
    # Typical positions differ by bf16 rounding only; a rare near-tie may route differently.
    assert per_position.median() < 0.05, per_position
    assert (per_position < 0.1).float().mean() >= 0.9, per_position
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize(("family", "sizes"), [
    ("qwen3_moe", {"hidden_size": 40, "moe_intermediate_size": 48}),
    ("deepseek_v2", {"moe_intermediate_size": 48}),
    ("mixtral", {"intermediate_size": 72}),
])
def test_odd_expert_sizes_end_to_end(family: str, sizes: dict, tiny_dir: Callable[..., Path]
                                     ) -> None:
    """Expert sizes that are not multiples of 32 load into the cpu backend (zero-padded inside)
    and the whole model equals the torch experts within bf16 rounding, greedy tokens too."""
    path = tiny_dir(family, dtype=torch.bfloat16, **sizes)
    cpu = LLM(path, device="cpu", dtype="float32", progress=False)
    ref = LLM(path, device="cpu", dtype="float32", experts="torch", progress=False)
    moe = cpu.model.model.layers[-1].mlp.experts.moe
    width = sizes.get("moe_intermediate_size", sizes.get("intermediate_size"))
    assert (moe.hidden, moe.intermediate) == (sizes.get("hidden_size", 64), width)
    ids = ref.encode("The quick brown fox jumps over the lazy dog.")
    per_position = (cpu.logits(ids) - ref.logits(ids)).abs().amax(dim=-1)  # [T]
    assert per_position.median() < 0.05, per_position
    assert cpu.generate(ids, max_new_tokens=8).token_ids[:4] == \
        ref.generate(ids, max_new_tokens=8).token_ids[:4]
