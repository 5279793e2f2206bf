"""Device check of the hybrid runtime on baby models (needs CUDA): the checks of
tests/engine/graph_device_checks.py (CUDA graphs, fused decode, deferral, window buckets, steps
launched ahead, abort) on every baby family; exits 1 if any fails. The same checks run as
`pytest -m device tests/engine/test_graph_device.py`.

    python benchmarks/engine/check_graph_device.py [--json FILE] [--families qwen3_moe,...]
        [--recompiles]

Each entry is printed the moment it is measured, with PASS / FAIL where it is a check (and the
tolerance of a |Δlogit|), and the JSON file is rewritten after each: a run cut by a time limit
still tells every check it reached. A section of checks that raises is printed (traceback, then
`error_<section>` FAIL) and the next one runs. `--recompiles` also logs Dynamo's recompile
reasons (to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# The checks and their pure-torch deferral oracle live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
from graph_device_checks import check_family  # noqa: E402
from graph_device_row import failures, tolerance, verdict  # noqa: E402

from hetmoe.presets.tiny import FAMILIES  # noqa: E402


class LiveRow(dict[str, Any]):
    """A family's row that prints each entry as it is set and saves every row so far."""

    def __init__(self, family: str, save: Any) -> None:
        super().__init__()
        self.family, self.save, self.start = family, save, time.perf_counter()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        ok = verdict(key, value)
        mark = "    " if ok is None else "PASS" if ok else "FAIL"
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        if ok is not None and "max_dlogit" in key:
            shown += f" (tol {tolerance(key):g})"
        print(f"{self.family:<12} {time.perf_counter() - self.start:7.1f}s {mark} {key} = "
              f"{shown}", flush=True)
        self.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here (after every entry)")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated baby families (default: all)")
    parser.add_argument("--recompiles", action="store_true",
                        help="log Dynamo's recompile reasons (torch._logging)")
    args = parser.parse_args()
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; expected some of {list(FAMILIES)}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (CI covers the CPU paths)")
        return 2
    if args.recompiles:
        torch._logging.set_logs(recompiles=True)
    rows: list[LiveRow] = []
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1, default=str))

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            row = LiveRow(family, save)
            rows.append(row)
            try:
                check_family(family, Path(tmp), row)
            except Exception as exc:  # setup failed: the row says so, the next family runs
                row["error_setup"] = f"{type(exc).__name__}: {exc}"[:500]
    ok = True
    for row in rows:
        failed = failures(row)
        ok &= not failed
        print(f"{row.family:<12} {'OK ' if not failed else 'BAD'} failed: {failed}")
    summary["ok"] = ok
    save()
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
