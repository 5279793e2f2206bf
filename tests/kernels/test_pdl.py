"""kernels/pdl.py's switch, on any machine: dependent launches only inside `allowed(True)`, never
on a CPU tensor's device or under the interpreter, off by HETMOE_DEPENDENT_LAUNCH=off, a bad
value named; the fused decode step allows them only where no layer has CPU work, or anywhere
with =always (the GPU's own test of the launches: test_pdl_device.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pdl = pytest.importorskip("hetmoe.kernels.pdl", reason="the kernels need Triton")

from hetmoe.engine.executor.fused_decode import FusedDecoder  # noqa: E402

CPU = torch.device("cpu")


def test_allowed_scopes_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.launch_args(CPU) == {"PDL": False}
    with pdl.allowed(True):
        assert not pdl.enabled(CPU)  # no GPU here: never a dependent launch
        with pdl.allowed(False):
            assert not pdl._ALLOWED.get()
        assert pdl._ALLOWED.get()
    assert not pdl._ALLOWED.get()


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:0 reads as a compute capability 9.0 GPU whose kernels are compiled."""
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(pdl.triton.knobs.runtime, "interpret", False)


@pytest.mark.usefixtures("hopper")
def test_the_variable_turns_it_off_and_a_bad_value_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cuda", 0)
    with pdl.allowed(True):
        assert pdl.enabled(gpu) and pdl.launch_args(gpu) == {"PDL": True, "launch_pdl": True}
        monkeypatch.setattr(pdl, "_capability", lambda index: (8, 9))
        assert not pdl.enabled(gpu)
        monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
        monkeypatch.setenv("HETMOE_DEPENDENT_LAUNCH", "off")
        assert not pdl.enabled(gpu)
        monkeypatch.setenv("HETMOE_DEPENDENT_LAUNCH", "maybe")
        with pytest.raises(ValueError, match="HETMOE_DEPENDENT_LAUNCH must be on, off or always"):
            pdl.enabled(gpu)
    monkeypatch.setenv("HETMOE_DEPENDENT_LAUNCH", "on")
    assert pdl.supported(gpu) and not pdl.enabled(gpu)  # outside `allowed`


def decoder(kernels: str, everything: bool | None, gqa_only: bool = True) -> FusedDecoder:
    """A FusedDecoder with only the fields `_dependent_launch` reads, on cuda:0: its placement
    holding every expert or not (None: no placement)."""
    made = FusedDecoder.__new__(FusedDecoder)
    placement = None if everything is None else SimpleNamespace(everything=everything)
    made.overlap = SimpleNamespace(placement=placement)  # type: ignore[assignment]
    made.kernels, made.gqa_only = kernels, gqa_only
    weight = SimpleNamespace(device=torch.device("cuda", 0))
    made.base = SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight))
    return made


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize(("kernels", "everything", "variable", "want"), [
    ("triton", True, "on", True), ("triton", False, "on", False), ("triton", None, "on", False),
    ("torch", True, "on", False), ("triton", True, "off", False),
    ("triton", False, "always", True), ("triton", None, "always", True),
    ("torch", None, "always", False)])
def test_the_decode_step_allows_them_only_without_cpu_work(
        monkeypatch: pytest.MonkeyPatch, kernels: str, everything: bool | None, variable: str,
        want: bool) -> None:
    monkeypatch.setenv("HETMOE_DEPENDENT_LAUNCH", variable)
    assert decoder(kernels, everything)._dependent_launch() is want


@pytest.mark.usefixtures("hopper")
def test_models_with_mla_layers_keep_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMOE_DEPENDENT_LAUNCH", "always")
    assert decoder("triton", True)._dependent_launch() is True
    assert decoder("triton", True, gqa_only=False)._dependent_launch() is False
