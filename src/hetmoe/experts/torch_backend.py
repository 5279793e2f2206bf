"""Plain-torch routed experts: the reference backend, on any torch device."""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from hetmoe.experts.backend import ExpertBackend, ExpertSpec, register_backend


@register_backend("torch")
class TorchExperts(ExpertBackend):
    """Stacked expert weights on `device`; tokens grouped by expert, one matmul pair per expert."""

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]

    def __init__(
        self,
        spec: ExpertSpec,
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str | None = None,
    ) -> None:
        if weight_format is not None:
            raise ValueError(
                f"torch experts keep the model dtype; weight_format={weight_format!r} needs the "
                "cpu backend"
            )
        super().__init__(spec, device, dtype)
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        # Non-persistent: the loader feeds them through load_tensor, never by state-dict name.
        self.register_buffer("gate", torch.empty(e, i, h, device=device, dtype=dtype), False)
        self.register_buffer("up", torch.empty(e, i, h, device=device, dtype=dtype), False)
        self.register_buffer("down", torch.empty(e, h, i, device=device, dtype=dtype), False)
        self.act = ACT2FN[spec.activation]

    def load_expert(
        self, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """Copies one expert's matrices into the stacked buffers (converting dtype/device)."""
        self.gate[expert].copy_(gate)
        self.up[expert].copy_(up)
        self.down[expert].copy_(down)

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """See `ExpertBackend.forward`."""
        t, k = expert_ids.shape
        # One row per (token, k) pick, summed over k at the end: index_copy_ with unique rows
        # stays single-threaded, where index_add_ pays for a parallel region per call.
        picks = torch.zeros(t * k, self.spec.hidden_size, device=x.device, dtype=torch.float32)
        flat = expert_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=self.spec.num_experts + 1)
        weights = expert_weights.reshape(-1)  # [T*K]
        start = int(counts[0])  # skipped (-1) picks sort first
        for expert, n in enumerate(counts[1:].tolist()):
            if n == 0:
                continue
            idx = order[start : start + n]  # pick positions in [T*K]
            start += n
            h = x[idx // k]  # [n, H]
            act = self.act(h @ self.gate[expert].T) * (h @ self.up[expert].T)  # [n, I]
            y = act @ self.down[expert].T  # [n, H]
            picks.index_copy_(0, idx, y.float() * weights[idx, None])
        return picks.view(t, k, -1).sum(dim=1).to(x.dtype)  # [T, H]
