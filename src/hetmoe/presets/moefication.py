"""MoEfication of a dense SwiGLU MLP: its neurons grouped into equal experts by co-activation, and a
linear router per layer trained to pick the experts whose outputs matter most for each token.

Per layer (x [N, H] the MLP input after its norm, a [N, I] = silu(gate x) * up x):
- experts: balanced k-means over the neurons' |a| patterns on a token sample (cosine), so
  neurons that fire on the same tokens share an expert (MoEfication, Zhang et al. 2022);
- shared expert (optional): the neurons of largest mean |a| kept on for every token, out of
  the clustering (measured, not adopted: docs/benchmarks/demo_moe.md);
- targets: expert e's output norm |down[:, e] a[:, e]| per token; the router is trained with
  cross-entropy against the top-k of those norms (each 1/k), on x;
- refit: SwiGLU activations are dense, so the dropped experts' share of the output is large;
  the down projection is refit by ridge regression (toward the dense one) so that the picked
  experts' sum best matches the dense output on the corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MoEficationConfig:
    num_experts: int = 16
    """Experts per layer; the intermediate size must split evenly."""
    top_k: int = 4
    """Experts per token the router is trained to pick."""
    cluster_tokens: int = 4096
    """Tokens whose activation patterns the neurons are clustered on."""
    kmeans_iters: int = 12
    """Balanced k-means iterations per layer."""
    router_steps: int = 150
    """Full-batch Adam steps per router (all layers at once)."""
    router_lr: float = 1e-2
    """Router learning rate."""
    ridge: float = 0.1
    """Down-projection refit penalty toward the dense weights, relative to the mean activation
    energy (0: plain least squares)."""
    seed: int = 0
    """Seeds the k-means start and nothing else (the rest is deterministic)."""
    shared_neurons: int = 0
    """Neurons of largest mean |activation| kept in an always-on shared expert, out of the
    routed experts (0: none); the rest split into the num_experts routed experts."""


@dataclass
class Activations:
    """One layer's dense MLP traffic over the corpus."""

    x: torch.Tensor
    """MLP input [N, H] (bf16)."""
    a: torch.Tensor
    """Intermediate activation silu(gate x) * up x [N, I] (bf16)."""


@torch.no_grad()
def collect(model: Any, windows: Sequence[Sequence[int]],
            advance: Callable[[int], None] = lambda n: None) -> list[Activations]:
    """Runs the dense llama `model` over `windows` (token id lists of one length), recording
    every layer's MLP input and intermediate activation; advance(1) per window."""
    layers = model.model.layers
    xs: list[list[torch.Tensor]] = [[] for _ in layers]
    acts: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        def record(_m: nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            xs[i].append(args[0].reshape(-1, args[0].shape[-1]).bfloat16())

        def record_act(_m: nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            acts[i].append(args[0].reshape(-1, args[0].shape[-1]).bfloat16())

        hooks.append(layer.mlp.register_forward_pre_hook(record))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(record_act))
    try:
        for ids in windows:
            model.model(torch.tensor([list(ids)]))  # the body only: no vocabulary projection
            advance(1)
    finally:
        for hook in hooks:
            hook.remove()
    return [Activations(torch.cat(x), torch.cat(a)) for x, a in zip(xs, acts, strict=True)]


def balanced_kmeans(features: torch.Tensor, num_clusters: int, iters: int,
                    generator: torch.Generator) -> torch.Tensor:
    """Cluster id [I] of each row of features [I, S], every cluster exactly I / num_clusters
    rows; cosine similarity, greedy balanced assignment (best pairs first)."""
    rows = features.shape[0]
    size = rows // num_clusters
    if size * num_clusters != rows:
        raise ValueError(f"{rows} neurons do not split into {num_clusters} equal experts")
    f = nn.functional.normalize(features.float(), dim=1)
    centroids = f[torch.randperm(rows, generator=generator)[:num_clusters]]
    labels = torch.zeros(rows, dtype=torch.long)
    for _ in range(iters):
        labels = _balanced_assign(f @ centroids.T, size)  # [I, E] similarities
        members = nn.functional.one_hot(labels, num_clusters).T.float()  # [E, I]
        centroids = nn.functional.normalize(members @ f, dim=1)
    return labels


def _balanced_assign(similarity: torch.Tensor, size: int) -> torch.Tensor:
    """Each row to its most similar cluster with room: every over-full cluster keeps its `size`
    most similar rows and the rest try their next choice (at most one round per cluster)."""
    rows, clusters = similarity.shape
    labels = torch.full((rows,), -1, dtype=torch.long)
    open_ = torch.ones(clusters, dtype=torch.bool)
    while (labels < 0).any():
        free = torch.nonzero(labels < 0).flatten()
        sim = similarity[free].masked_fill(~open_, float("-inf"))
        best = sim.argmax(1)
        for cluster in best.unique().tolist():
            mine = free[best == cluster]
            room = size - int((labels == cluster).sum())
            if len(mine) > room:  # keep the most similar, close the cluster
                mine = mine[similarity[mine, cluster].argsort(descending=True)[:room]]
            labels[mine] = cluster
            if len(mine) == room:
                open_[cluster] = False
    return labels


def shared_neurons(acts: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [count] (ascending) of the neurons of largest mean |a| over a layer's
    activations a [N, I]: those every token leans on, kept out of routing."""
    mean = acts.float().abs().mean(0)  # [I]
    return mean.topk(count).indices.sort().values


def expert_groups(acts: torch.Tensor, config: MoEficationConfig, generator: torch.Generator,
                  shared: torch.Tensor | None = None) -> torch.Tensor:
    """Neuron indices [E, (I - S)/E] of each routed expert, from a layer's activations a [N, I],
    the `shared` neurons [S] left out."""
    neurons = torch.arange(acts.shape[1])
    if shared is not None:
        neurons = neurons[~torch.isin(neurons, shared)]
    sample = acts[: config.cluster_tokens, neurons].float().abs().T  # [I - S, S_tokens]
    labels = balanced_kmeans(sample, config.num_experts, config.kmeans_iters, generator)
    return torch.stack([neurons[labels == e] for e in range(config.num_experts)])


@torch.no_grad()
def expert_norms(acts: torch.Tensor, down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """|expert e's output| [N, E] per token: down [H, I] restricted to each group."""
    norms = []
    for idx in groups:
        out = acts[:, idx].float() @ down[:, idx].T  # [N, H]
        norms.append(out.norm(dim=1))
    return torch.stack(norms, dim=1)


def train_routers(xs: torch.Tensor, norms: torch.Tensor,
                  config: MoEficationConfig) -> torch.Tensor:
    """Router weights [L, E, H] trained on inputs xs [L, N, H] to put the top-k of each
    token's expert norms [L, N, E] first (cross-entropy against 1/k on each of them)."""
    layers, _, hidden = xs.shape
    top = norms.topk(config.top_k, dim=-1).indices
    target = torch.zeros_like(norms).scatter_(-1, top, 1.0 / config.top_k)  # [L, N, E]
    x = xs.float()
    weight = torch.zeros(layers, hidden, config.num_experts, requires_grad=True)
    opt = torch.optim.Adam([weight], lr=config.router_lr)
    for _ in range(config.router_steps):
        logits = torch.bmm(x, weight)  # [L, N, E]
        loss = -(target * logits.log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return weight.detach().transpose(1, 2).contiguous()


@torch.no_grad()
def refit_down(acts: torch.Tensor, down: torch.Tensor, groups: torch.Tensor,
               picks: torch.Tensor, ridge: float,
               shared: torch.Tensor | None = None) -> torch.Tensor:
    """down [H, I] refit so that the shared neurons [S] plus each token's picked experts
    [N, k] (sum of down[:, e] a[:, e]) best match the dense output down a (ridge toward
    `down`)."""
    a = acts.float()  # [N, I]
    num_experts, size = groups.shape
    picked = torch.zeros(a.shape[0], num_experts).scatter_(1, picks, 1.0)  # [N, E]
    mask = torch.zeros_like(a)
    mask[:, groups.flatten()] = picked.repeat_interleave(size, dim=1)
    if shared is not None:
        mask[:, shared] = 1.0
    masked = a * mask
    gram = masked.T @ masked  # [I, I]
    penalty = ridge * gram.diagonal().mean()
    rhs = masked.T @ (a @ down.T) + penalty * down.T  # [I, H]
    eye = torch.eye(gram.shape[0])
    return torch.linalg.solve(gram + penalty * eye, rhs).T.contiguous()


@dataclass
class MoEfied:
    """Every layer's split of its MLP: what a checkpoint is written from."""

    shared: list[torch.Tensor]
    """Shared neuron indices [S] per layer (empty without a shared expert)."""
    groups: list[torch.Tensor]
    """Routed experts' neuron indices [E, (I - S)/E] per layer."""
    routers: torch.Tensor
    """Router weights [L, E, H]."""
    downs: list[torch.Tensor]
    """Refit down projections [H, I] per layer."""
    recall: float
    """Share of each token's top-k largest-norm experts its router picks (the corpus)."""


def moefy(acts: list[Activations], downs: list[torch.Tensor], config: MoEficationConfig,
          advance: Callable[[int], None] = lambda n: None) -> MoEfied:
    """Splits each layer (activations, dense down [H, I]) into a shared expert and routed
    experts, trains the routers and refits the down projections; advance(1) per layer twice,
    and once for the routers."""
    shared, groups, norms = [], [], []
    for i, (layer, down) in enumerate(zip(acts, downs, strict=True)):
        generator = torch.Generator().manual_seed(config.seed + i)
        shared.append(shared_neurons(layer.a, config.shared_neurons))
        groups.append(expert_groups(layer.a, config, generator, shared[-1]))
        norms.append(expert_norms(layer.a, down, groups[-1]))
        advance(1)
    xs = torch.stack([layer.x for layer in acts])  # [L, N, H]
    all_norms = torch.stack(norms)  # [L, N, E]
    # Every other token trains the router (enough for H x E weights, half the time).
    routers = train_routers(xs[:, ::2], all_norms[:, ::2], config)  # [L, E, H]
    advance(1)
    want = all_norms.topk(config.top_k, dim=-1).indices  # [L, N, k]
    got = torch.bmm(xs.float(), routers.transpose(1, 2)).topk(config.top_k, dim=-1).indices
    recall = float((got.unsqueeze(-1) == want.unsqueeze(-2)).any(-1).float().mean())
    refit = []
    for i, (layer, down) in enumerate(zip(acts, downs, strict=True)):
        refit.append(refit_down(layer.a, down, groups[i], got[i], config.ridge, shared[i]))
        advance(1)
    return MoEfied(shared, groups, routers, refit, recall)
