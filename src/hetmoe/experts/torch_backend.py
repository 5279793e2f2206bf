"""Plain-torch routed experts: the reference backend, on any torch device."""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from hetmoe.experts.backend import ExpertBackend, ExpertSpec, register_backend
from hetmoe.experts.routed_mlp import combine, expert_loop, expert_rows


@register_backend("torch")
class TorchExperts(ExpertBackend):
    """Stacked expert weights on `device`; tokens grouped by expert, one matmul pair per expert
    (`routed_mlp.expert_rows`/`expert_loop`/`combine`, as the GPU prefill)."""

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
        """See `ExpertBackend.forward`: `routed_mlp`'s grouping and sum, in the model dtype."""
        rows = expert_rows(expert_ids, self.spec.num_experts, skips=True)
        y = torch.zeros(rows.pair.shape[0], self.spec.hidden_size, device=x.device,
                        dtype=torch.float32)  # [R, H]
        expert_loop(x[rows.token], rows.bounds(), self._mlp, y)
        return combine(y, rows, expert_weights, x)

    def _mlp(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        """One expert on its rows h [m, H] -> [m, H], in the model dtype."""
        act = self.act(h @ self.gate[expert].T) * (h @ self.up[expert].T)  # [m, I]
        return act @ self.down[expert].T
