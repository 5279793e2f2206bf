"""Does a short distillation against the dense logits close `demo-moe`'s quality gap, within its
build budget? Measures it on the built preset, without changing the preset.

The routers stay fixed; every layer's experts (gate, up, down) are trained with KL(dense || MoE) of
the next-token distributions on the build's own training windows (the dense model's chat replies
and the pydoc topics' training split, `demo_moe.training_windows`), one window of 256 tokens per
Adam step, the learning rate decaying linearly to 0. The MoE is computed masked densely (each
neuron's activation times its expert's renormalized softmax weight, zero outside the top-k:
Mixtral's math, checked against transformers at start), so the trained weights drop into the
checkpoint unchanged. Prints the held-out perplexity (the quality benchmark's windows) before and
after, and the wall time of the training alone; with --out writes the distilled checkpoint, which
`HETMOE_CACHE_DIR=D python benchmarks/demo_moe/quality.py ...` measures when D/models holds it
as demo-moe-v<version> beside a link to the cached demo-v<version>.

Usage: python benchmarks/demo_moe/distill.py [--steps 40] [--lr 3e-4] [--evals 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from demo_moe_eval import held_out_windows, perplexity
from safetensors.torch import load_file
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

from hetmoe.loading.gguf import open_gguf
from hetmoe.loading.shards import write_shards
from hetmoe.presets import resolve_model
from hetmoe.presets.demo import smollm2_gguf
from hetmoe.presets.demo_moe import NAME, WINDOW, dense_llama, training_windows


class MaskedMoE(nn.Module):
    """One layer's experts as a dense SwiGLU MLP whose neurons are masked and weighted per token
    by the router: neurons [e * size, (e + 1) * size) are expert e's."""

    def __init__(self, moe: dict[str, torch.Tensor], prefix: str, experts: int, top_k: int):
        super().__init__()
        def cat(w: str, dim: int) -> nn.Parameter:
            return nn.Parameter(torch.cat([moe[f"{prefix}.experts.{e}.{w}.weight"]
                                           for e in range(experts)], dim=dim).float())
        self.gate, self.up, self.down = cat("w1", 0), cat("w3", 0), cat("w2", 1)  # [I,H] x2, [H,I]
        self.router: torch.Tensor
        self.register_buffer("router", moe[f"{prefix}.gate.weight"].float())  # [E, H]
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H]
        probs = (x @ self.router.T).softmax(-1)  # [..., E]
        top, idx = probs.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        size = self.gate.shape[0] // self.router.shape[0]
        a = nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)  # [..., I]
        return (a * weights.repeat_interleave(size, dim=-1)) @ self.down.T

    def expert_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        size = self.gate.shape[0] // self.router.shape[0]
        out = {}
        for e in range(self.router.shape[0]):
            rows = slice(e * size, (e + 1) * size)
            out[f"{prefix}.experts.{e}.w1.weight"] = self.gate.data[rows].contiguous()
            out[f"{prefix}.experts.{e}.w3.weight"] = self.up.data[rows].contiguous()
            out[f"{prefix}.experts.{e}.w2.weight"] = self.down.data[:, rows].contiguous()
        return out


def distill(student: Any, windows: Sequence[list[int]], targets: Sequence[torch.Tensor],
            steps: int, lr: float, after_step: Callable[[int], None]) -> list[float]:
    """Trains the student's MaskedMoE weights toward the dense distributions, given as the dense
    model's final hidden states `targets` [T, H] per window (through the shared, frozen
    vocabulary projection); one window per step in a seeded order. Returns each step's KL."""
    params = [p for m in student.modules() if isinstance(m, MaskedMoE)
              for p in (m.gate, m.up, m.down)]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        w = int(order[step % len(windows)])
        with torch.no_grad():
            want = student.lm_head(targets[w]).log_softmax(-1)  # [T, V]
        got = student(torch.tensor([windows[w]])).logits[0].log_softmax(-1)
        loss = nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
        losses.append(float(loss.detach()))
        after_step(step + 1)
    return losses


def held_out_ppl(model: Any, windows: Sequence[list[int]]) -> float:
    """Held-out perplexity of a transformers causal LM (one forward per window)."""
    return perplexity(lambda ids: model(torch.tensor([ids])).logits[0], windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--evals", type=int, default=0, help="held-out perplexity every N steps")
    parser.add_argument("--held-out-windows", type=int, default=6)
    parser.add_argument("--out", type=Path, help="write the distilled checkpoint here")
    args = parser.parse_args()
    source = resolve_model(NAME)
    config = MixtralConfig.from_pretrained(str(source))
    gguf = open_gguf(smollm2_gguf())
    llama = gguf.llama_config()
    tensors = dict(gguf.llama_tensors())
    dense = dense_llama(llama, tensors)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source))
    windows, _ = training_windows(dense, tokenizer)  # the build's own
    held = held_out_windows(lambda t: tokenizer.encode(t, add_special_tokens=False), WINDOW,
                            args.held_out_windows)
    with torch.no_grad():
        targets = [dense.model(torch.tensor([w])).last_hidden_state[0] for w in windows]
    moe = {}
    for shard in sorted(source.glob("*.safetensors")):
        moe.update(load_file(str(shard)))
    student = dense_llama(llama, {k: v.clone() for k, v in tensors.items()})
    for i, layer in enumerate(student.model.layers):
        layer.mlp = MaskedMoE(moe, f"model.layers.{i}.block_sparse_moe",
                              config.num_local_experts, config.num_experts_per_tok)
    with torch.no_grad():  # the masked MoE is the checkpoint's Mixtral
        ref = MixtralForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
        gap = (ref(torch.tensor([held[0]])).logits - student(torch.tensor([held[0]])).logits)
    print(f"max |logits - transformers' Mixtral| {gap.abs().max():.2e}")
    del ref
    print(f"held-out perplexity: dense {held_out_ppl(dense, held):.3f}, "
          f"{NAME} {held_out_ppl(student, held):.3f}", flush=True)
    start = time.perf_counter()
    spent = [0.0]

    def after_step(step: int) -> None:
        if args.evals and step % args.evals == 0:
            t = time.perf_counter()
            print(f"step {step}: held-out perplexity {held_out_ppl(student, held):.3f}", flush=True)
            spent[0] += time.perf_counter() - t

    losses = distill(student, windows, targets, args.steps, args.lr, after_step)
    wall = time.perf_counter() - start - spent[0]
    k = min(8, len(losses))
    print(f"{args.steps} steps, lr {args.lr:g}: {wall:.0f} s training ({wall / args.steps:.2f} s "
          f"per step); train KL {sum(losses[:k]) / k:.3f} (first {k}) -> "
          f"{sum(losses[-k:]) / k:.3f} (last {k}); held-out perplexity "
          f"{held_out_ppl(student, held):.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if not f.name.endswith((".safetensors", ".index.json")):
                shutil.copy(f, args.out / f.name)
        for i, layer in enumerate(student.model.layers):
            moe.update(layer.mlp.expert_tensors(f"model.layers.{i}.block_sparse_moe"))
        write_shards(args.out, iter(moe.items()), 1 << 30)


if __name__ == "__main__":
    main()
