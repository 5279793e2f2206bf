"""Expert backends: tensor intake (per expert and fused), errors, and forward against float64."""

from __future__ import annotations

import pytest
import torch

from hetmoe.experts.backend import ExpertSpec, backends, get_backend
from hetmoe.experts.torch_backend import TorchExperts

SPEC = ExpertSpec(num_experts=5, hidden_size=32, intermediate_size=48)


def random_experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    e, h, i = SPEC.num_experts, SPEC.hidden_size, SPEC.intermediate_size
    gate = torch.randn(e, i, h, generator=gen) / h**0.5
    up = torch.randn(e, i, h, generator=gen) / h**0.5
    return gate, up, torch.randn(e, h, i, generator=gen) / i**0.5


def reference(x, ids, weights, gate, up, down) -> torch.Tensor:
    """Σ_k w_k · down_e(silu(gate_e x) ⊙ up_e x) in float64, token by token."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            xt = x[t].double()
            act = torch.nn.functional.silu(gate[e].double() @ xt) * (up[e].double() @ xt)
            out[t] += float(weights[t, k]) * (down[e].double() @ act)
    return out


def loaded(fused: bool = False) -> TorchExperts:
    gate, up, down = random_experts()
    experts = TorchExperts(SPEC, torch.device("cpu"), torch.float32)
    if fused:
        experts.load_tensor("gate_up_proj", torch.cat([gate, up], dim=1))
        experts.load_tensor("down_proj", down)
    else:
        for e in range(SPEC.num_experts):
            experts.load_tensor(f"{e}.down_proj.weight", down[e])
            experts.load_tensor(f"{e}.gate_proj.weight", gate[e])
            experts.load_tensor(f"{e}.up_proj.weight", up[e].to(torch.bfloat16).float())
    return experts


@pytest.mark.parametrize("fused", [False, True])
def test_forward_matches_float64_reference(fused: bool) -> None:
    gate, up, down = random_experts()
    if not fused:
        up = up.to(torch.bfloat16).float()
    experts = loaded(fused)
    assert experts.missing() == []
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, SPEC.hidden_size, generator=gen)
    ids = torch.tensor([[0, 4], [4, 4], [-1, 2], [-1, -1], [3, 1], [2, 0], [1, -1]])  # dup, skip
    weights = torch.rand(7, 2, generator=gen)
    out = experts(x, ids, weights)
    assert out.shape == (7, SPEC.hidden_size) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, ids, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros(SPEC.hidden_size))
    experts.submit(x, ids, weights)
    assert torch.equal(experts.sync(), out)


def test_missing_lists_what_has_not_arrived() -> None:
    gate, up, down = random_experts()
    experts = TorchExperts(SPEC, torch.device("cpu"), torch.float32)
    experts.load_tensor("1.gate_proj.weight", gate[1])
    experts.load_tensor("1.up_proj.weight", up[1])
    missing = experts.missing()
    assert "1.down_proj.weight" in missing and "1.gate_proj.weight" not in missing
    assert len(missing) == 3 * SPEC.num_experts - 2


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("2.gate_proj.weight", (32, 48), r"expert tensor '2.gate_proj.weight': expected shape "
                                         r"\[48, 32\], found \[32, 48\]"),
        ("9.up_proj.weight", (48, 32), r"tensor '9.up_proj.weight': expert 9 out of range "
                                       r"\(layer has 5\)"),
        ("2.w1.weight", (48, 32), r"expert backend got tensor '2.w1.weight'; expected "),
        ("down_proj", (5, 32, 32), r"expert tensor 'down_proj': expected shape \[5, 32, 48\]"),
    ],
)
def test_bad_tensors_are_named(name: str, shape: tuple[int, ...], message: str) -> None:
    experts = TorchExperts(SPEC, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=message):
        experts.load_tensor(name, torch.zeros(shape))


def test_submit_sync_misuse_and_registry() -> None:
    experts = loaded()
    with pytest.raises(RuntimeError, match="sync called without submit"):
        experts.sync()
    x, ids, w = torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    experts.submit(x, ids, w)
    with pytest.raises(RuntimeError, match="submit called twice without sync"):
        experts.submit(x, ids, w)
    assert backends()["torch"] is TorchExperts
    with pytest.raises(ValueError, match=r"unknown expert backend 'gpu9' \(known: .*torch"):
        get_backend("gpu9")
