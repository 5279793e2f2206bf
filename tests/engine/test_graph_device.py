"""The default GPU path (CUDA graphs + compiled fused decode + stream flags) on every baby family:
the checks of graph_device_checks.py as device tests (`pytest -m device` on a GPU host; the same
checks print each entry as measured through `benchmarks/engine/check_graph_device.py`)."""

from __future__ import annotations

from pathlib import Path

import graph_device_checks as checks
import pytest
import torch
from graph_device_row import failures

from hetmoe.presets.tiny import FAMILIES

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device machine)"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_equals_the_reference_paths(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    row = checks.check_family(family, tmp_path)
    # every failing check with its value (a section that raised: error_<section>)
    assert not failures(row), f"{family}: {failures(row)}"
