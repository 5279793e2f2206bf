"""`EngineConfig.check_deferred`: the `deferred` option against the run it is for, in one place."""

from __future__ import annotations

import pytest

from hetmoe.config import EngineConfig


def test_deferred_needs_gpu_decode_then_cpu_experts() -> None:
    EngineConfig().check_deferred("cpu", cpu_experts=False)  # deferred=0 runs anywhere
    EngineConfig(deferred=2).check_deferred("cuda", cpu_experts=True)
    with pytest.raises(ValueError, match=r"^option deferred=2 needs GPU decode with every MoE "
                       r"layer's routed experts in the cpu backend; this run decodes on cpu "
                       r"\(use deferred=0\)$"):
        EngineConfig(deferred=2).check_deferred("cpu", cpu_experts=True)
    with pytest.raises(ValueError, match=r"^option deferred=1 needs every MoE layer's routed "
                       r"experts in the cpu backend \(use deferred=0\)$"):
        EngineConfig(deferred=1).check_deferred("cuda", cpu_experts=False)
    with pytest.raises(ValueError, match=r"option deferred must be 'auto' or an integer >= 0, "
                                         r"got -1"):
        EngineConfig(deferred=-1)
    # auto fits any run: it picks 0 where deferral cannot run (engine/model/deferral_auto.py).
    EngineConfig(deferred="auto").check_deferred("cpu", cpu_experts=False)
