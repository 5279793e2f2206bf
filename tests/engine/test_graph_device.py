"""The default GPU path (CUDA graphs + compiled fused decode + stream flags) on every baby family:
the checks of graph_device_checks.py as device tests (`pytest -m device` on a GPU host; the same
checks print a table through `benchmarks/engine/check_graph_device.py`)."""

from __future__ import annotations

from pathlib import Path

import graph_device_checks as checks
import pytest
import torch

from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_equals_the_reference_paths(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    row = checks.check_family(family, tmp_path)
    failed = [k for k, v in row.items() if k.startswith("graph_") and v is False]
    assert not failed, f"{family}: {failed}"
    assert row["llm_uses_graphs"] and row["llm_fused_as_planned"]
    over = {k: v for k, v in row.items() if "max_dlogit" in k and "torch_reference" not in k
            and v > checks.tolerance(k)}
    assert not over, f"{family}: |Δlogit| over tolerance: {over}"
