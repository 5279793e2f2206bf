"""The default GPU path (CUDA graphs + compiled fused decode + stream flags) on every baby family:
`benchmarks/engine/check_graph_device.py`'s checks as device tests (`pytest -m device` on a GPU
host)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


def _checks() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "engine" / "check_graph_device.py"
    spec = importlib.util.spec_from_file_location("check_graph_device", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_equals_the_reference_paths(family: str, tmp_path: Path) -> None:
    checks = _checks()
    torch.manual_seed(0)
    row = checks.check_family(family, tmp_path)
    failed = [k for k, v in row.items() if k.startswith("graph_") and v is False]
    assert not failed, f"{family}: {failed}"
    assert row["llm_uses_graphs"] and row["llm_fused_as_planned"]
    over = {k: v for k, v in row.items() if "max_dlogit" in k and "torch_reference" not in k
            and v > checks.tolerance(k)}
    assert not over, f"{family}: |Δlogit| over tolerance: {over}"
