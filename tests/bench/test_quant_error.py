"""benchmarks/kernels/quant_error.py: its simulated quantizers give what `CpuMoE`'s packed int8
gives (so its per-channel rows stand for a format the kernels do not have), and the errors order
as the groups widen."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "quant_error.py"


def test_simulation_matches_the_kernels_and_orders_by_group(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    report = runpy.run_path(str(SCRIPT))["main"](["--tokens", "48", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # tuples as lists
    rows = {r["case"]: r for r in report["rows"]}
    packed = [r for r in report["rows"] if "cpu_moe" in r]
    assert [r["weight_groups"][0] for r in packed] == [64, 128, 256]
    for r in packed:  # the same quantizers: equal up to fp32 sums
        assert abs(r["simulated"] - r["cpu_moe"]) <= 1e-3 * r["cpu_moe"], r
    errors = [r["simulated"] for r in packed]
    assert errors == sorted(errors) and errors[0] > 0
    per_channel = rows["per-channel weights, per-token activations"]["simulated"]
    assert per_channel > rows["groups of 256"]["simulated"]
