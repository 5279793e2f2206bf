"""AMX against float64 and AVX-512/AVX2 at Qwen3-30B-A3B's expert shape, per format: the checks
of amx_device_checks.py as device tests (`pytest -m device` on an AMX host). Asked for on a host
without AMX, they fail: a device run that checked nothing must not pass."""

from __future__ import annotations

import amx_device_checks as checks
import pytest

from hetmoe import _cpu

pytestmark = pytest.mark.device


@pytest.mark.parametrize("spec", list(checks.BOUND))
def test_amx_matches_float64_and_the_other_isas(spec: str) -> None:
    best = _cpu.best_isa()
    assert best == "amx", f"AMX is not available here (best ISA: {best}); run on an AMX host"
    row = checks.check_format(spec)
    print(row)  # the numbers of a passing run: pytest -rP
    assert row["passed"], f"{spec}: a bound is exceeded: {row}"
