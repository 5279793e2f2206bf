"""MoEfication's shared expert: which neurons it keeps, the routed experts left around it, and
the down refit that counts it for every token."""

from __future__ import annotations

import torch

from hetmoe.presets.moefication import (
    MoEficationConfig,
    expert_groups,
    refit_down,
    shared_neurons,
)


def test_shared_neurons_are_those_of_largest_mean_activation() -> None:
    acts = torch.tensor([[1.0, -5.0, 0.1, 3.0], [1.0, 5.0, -0.1, -3.0]])  # [N, I]
    assert shared_neurons(acts, 2).tolist() == [1, 3]
    assert shared_neurons(acts, 0).tolist() == []


def test_routed_experts_split_the_other_neurons_evenly() -> None:
    acts = torch.randn(64, 24, generator=torch.Generator().manual_seed(0))
    shared = torch.tensor([0, 5, 7, 20])
    config = MoEficationConfig(num_experts=4, shared_neurons=4, kmeans_iters=3)
    groups = expert_groups(acts, config, torch.Generator().manual_seed(1), shared)
    assert groups.shape == (4, 5)
    assert sorted(groups.flatten().tolist() + shared.tolist()) == list(range(24))


def test_refit_counts_the_shared_neurons_for_every_token() -> None:
    gen = torch.Generator().manual_seed(2)
    acts, down = torch.randn(200, 8, generator=gen), torch.randn(3, 8, generator=gen)
    shared, groups = torch.tensor([0, 1]), torch.tensor([[2, 3, 4], [5, 6, 7]])
    picks = torch.randint(0, 2, (200, 1), generator=gen)  # [N, k]
    refit = refit_down(acts, down, groups, picks, ridge=0.0, shared=shared)
    mask = torch.zeros(200, 8)
    mask[:, :2] = 1.0
    for e in range(2):
        mask[(picks[:, 0] == e).nonzero(), groups[e]] = 1.0
    # Plain least squares over the kept activations (shared + picked) toward the dense output.
    want = torch.linalg.lstsq(acts * mask, acts @ down.T).solution.T  # [H, I]
    assert torch.allclose(refit, want, atol=1e-4)
    without = refit_down(acts, down, groups, picks, ridge=1e-3)
    assert (without - want).abs().max() > 0.1  # the shared neurons change the fit
