"""Routed-expert backends: the `ExpertBackend` interface, plain torch, and the C++ CPU backend."""

from __future__ import annotations

from typing import Any

__all__ = ["CpuMoE", "ExpertBackend", "TorchExperts"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not load the C++ extension or torch until asked.
    if name == "CpuMoE":
        from hetmoe.experts.cpu_moe import CpuMoE

        return CpuMoE
    if name == "ExpertBackend":
        from hetmoe.experts.backend import ExpertBackend

        return ExpertBackend
    if name == "TorchExperts":
        from hetmoe.experts.torch_backend import TorchExperts

        return TorchExperts
    raise AttributeError(f"module 'hetmoe.experts' has no attribute {name!r}")
