"""Routed experts in CPU DRAM, computed by the C++ kernels (`CpuMoE`), behind `ExpertBackend`.

Experts are packed one by one as the loader streams them in (`load_expert`), so a layer never
holds a second full copy. Calls convert at the boundary: activations go in as bf16 or fp32 CPU
tensors (fp16 as fp32), the output comes back in the caller's dtype on the caller's device.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from hetmoe.experts.backend import ExpertBackend, ExpertSpec, register_backend
from hetmoe.experts.cpu_moe import CpuMoE, PendingCall
from hetmoe.experts.fp8_weight import Fp8Weight


@register_backend("cpu")
class CpuExperts(ExpertBackend):
    """Routed experts on the CPU (bf16, int8, int4 or fp8 packed weights), any model device."""

    def __init__(
        self,
        spec: ExpertSpec,
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str | None = None,
        group_size: int | None = None,
    ) -> None:
        # The experts live in CPU memory whatever the op's device; the op moves activations.
        super().__init__(spec, torch.device("cpu"), dtype)
        self.moe = CpuMoE(
            spec.num_experts, spec.hidden_size, spec.intermediate_size,
            weight_format=weight_format or "bf16", group_size=group_size,
            activation=spec.activation,
        )
        self._call: PendingCall | None = None
        self._out_dtype = dtype
        self.keeps_fp8 = self.moe.weight_format == "fp8"

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run here (None when it can)."""
        if importlib.util.find_spec("hetmoe._cpu") is None:
            return "the C++ extension hetmoe._cpu is not built"
        from hetmoe import _cpu  # found above; imported only here, as every user of it

        if not hasattr(_cpu, "MoELayer"):
            return "the C++ extension hetmoe._cpu has no MoE kernels (rebuild it)"
        return None

    def load_expert(self, expert: int, gate: torch.Tensor | Fp8Weight,
                    up: torch.Tensor | Fp8Weight, down: torch.Tensor | Fp8Weight) -> None:
        """Packs one expert into the C++ layout (quantizing if the format asks; FP8 weights as
        stored for the fp8 format, named by CpuMoE when they are not FP8)."""
        if isinstance(gate, Fp8Weight) and isinstance(up, Fp8Weight) and isinstance(down,
                                                                                  Fp8Weight):
            block = (gate.scheme.block_rows, gate.scheme.block_cols)
            self.moe.load_expert(expert, gate.weight, up.weight, down.weight, gate.scale_inv,
                                 up.scale_inv, down.scale_inv, fp8_block=block)
            return
        g, u, d = (p.dequantize() if isinstance(p, Fp8Weight) else p for p in (gate, up, down))
        self.moe.load_expert(expert, g, u, d)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """See `ExpertBackend.forward`; synchronous."""
        out = self.moe.forward(*self._inputs(x, expert_ids, expert_weights))
        return out.to(x.dtype)

    def submit(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> None:
        """Starts the layer on the CPU pool and returns at once."""
        if self._call is not None:
            raise RuntimeError("ExpertBackend.submit called twice without sync")
        self._out_dtype = x.dtype
        self._call = self.moe.submit(*self._inputs(x, expert_ids, expert_weights))

    def sync(self) -> torch.Tensor:
        """Waits for the submitted layer; [T, H] in the submitted activations' dtype."""
        if self._call is None:
            raise RuntimeError("ExpertBackend.sync called without submit")
        call, self._call = self._call, None
        return self.moe.sync(call).to(self._out_dtype)

    def discard(self) -> None:
        """Waits for a submitted call, if any, and drops its output (a step that failed between
        submit and sync; its error is the one being reported)."""
        call, self._call = self._call, None
        if call is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                self.moe.sync(call)

    @staticmethod
    def _inputs(
        x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
        cpu = torch.device("cpu")
        return (
            x.to(cpu, dtype).contiguous(),  # [T, H]
            expert_ids.to(cpu, torch.int64).contiguous(),  # [T, K]
            expert_weights.to(cpu, torch.float32).contiguous(),  # [T, K]
        )
