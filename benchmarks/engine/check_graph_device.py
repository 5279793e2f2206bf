"""Device check of the hybrid runtime on baby models (needs CUDA): the checks of
tests/engine/graph_device_checks.py (CUDA graphs, fused decode, deferral, window buckets, steps
launched ahead, abort) on every baby family, as a table and JSON; exits 1 if any fails. The same
checks run as `pytest -m device tests/engine/test_graph_device.py`.

    python benchmarks/engine/check_graph_device.py [--json FILE] [--families qwen3_moe,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

# The checks and their pure-torch deferral oracle live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
from graph_device_checks import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
