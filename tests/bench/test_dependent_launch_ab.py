"""benchmarks/engine/dependent_launch_ab.py without a GPU: each variant's process (its
HETMOE_DEPENDENT_LAUNCH and patch, which must name what exists), the rounds alternating, the
table's means and ratios to `off`, a failed run named."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from bench_script import load_script

AB = load_script("engine/dependent_launch_ab.py")


def result(tok_s: dict[str, float]) -> dict[str, Any]:
    """A bench_gpu_experts.py JSON reduced to its decode rows."""
    return {"rows": [{"budget": budget, "tok_s": value} for budget, value in tok_s.items()]}


def test_each_variant_runs_the_benchmark_with_its_setting(tmp_path: Path) -> None:
    for variant, setting in AB.SETTING.items():
        argv, env = AB.command(variant, ["--budgets", "0"], tmp_path / "r.json")
        assert env["HETMOE_DEPENDENT_LAUNCH"] == setting
        assert argv[-4:] == ["--budgets", "0", "--json", str(tmp_path / "r.json")]
        ast.parse(argv[2])  # the -c program
        assert "bench_gpu_experts.py" in argv[2]
    with pytest.raises(ValueError, match="unknown variant 'sometimes'"):
        AB.command("sometimes", [], tmp_path / "r.json")


PROBE = """
import json, sys
import torch
from hetmoe.engine.executor import fused_decode as f
from hetmoe.kernels import pdl
decoder = f.FusedDecoder.__new__(f.FusedDecoder)
decoder.kernels = "triton"
with pdl.allowed(True):
    state = {"inductor": f._inductor_options(True), "ours": pdl.enabled(torch.device("cpu")),
             "step": decoder._dependent_launch() if sys.argv[1] == "inductor" else None}
json.dump(state, open(sys.argv[sys.argv.index("--json") + 1], "w"))
"""


@pytest.mark.parametrize(("variant", "inductor", "step"), [
    ("kernels", {}, None), ("inductor", {"triton.enable_pdl": True}, True)])
def test_the_split_variants_patch_what_they_say(tmp_path: Path, variant: str,
                                                inductor: dict[str, bool],
                                                step: bool | None) -> None:
    pytest.importorskip("hetmoe.kernels.pdl", reason="the kernels need Triton")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    argv, env = AB.command(variant, [variant], tmp_path / "r.json", bench=probe)
    subprocess.run(argv, env=env, check=True, timeout=120)
    state = json.loads((tmp_path / "r.json").read_text())
    assert state == {"inductor": inductor, "ours": False, "step": step}


def test_rounds_alternate_and_the_table_gives_means_and_ratios(tmp_path: Path) -> None:
    speeds = {"off": [{"0": 50.0, "all": 296.0}, {"0": 52.0, "all": 294.0}],
              "always": [{"0": 44.0, "all": 316.0}, {"0": 46.0, "all": 318.0}]}
    order = []

    def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        variant = {"off": "off", "always": "always"}[env["HETMOE_DEPENDENT_LAUNCH"]]
        out = Path(argv[argv.index("--json") + 1])
        out.write_text(json.dumps(result(speeds[variant][len([o for o in order
                                                                if o == variant])])))
        order.append(variant)
        return subprocess.CompletedProcess(argv, 0)

    runs = AB.run_all(["off", "always"], 2, ["--budgets", "0,all"], tmp_path, run)
    assert order == ["off", "always", "off", "always"]
    text, rows = AB.table(runs)
    assert rows == [{"budget": "0", "off": 51.0, "always": 45.0},
                    {"budget": "all", "off": 295.0, "always": 317.0}]
    assert "| 0 | 51.0 | 45.0 | 0.882x |" in text
    assert "| all | 295.0 | 317.0 | 1.075x |" in text


def test_a_failed_run_is_named(tmp_path: Path) -> None:
    def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1)

    with pytest.raises(RuntimeError, match="the on run of round 0 failed \\(exit 1\\)"):
        AB.run_all(["on"], 1, [], tmp_path, run)
