"""Does an always-on shared expert make a better `demo-moe`? MoEfication variants compared at
the same share of neurons per token, each computed by masking the dense model's neurons (the
checkpoint's math with routing weights exactly 1; Mixtral's or Qwen2-MoE's stored weights are
1/top-k within a few percent and the down projections scaled by top-k).

Per variant (shared neurons S, routed experts E, top-k): the build's own steps
(`moefication.moefy`: the S neurons of largest mean |activation| always on, the rest clustered
into E experts, routers trained, down refit) on the build's corpus (`demo_moe.training_windows`,
collected once), then held-out perplexity on the same windows as `quality.py` and
greedy exact match on its questions (those dense `demo` answers right). Writes JSON and the table
between docs/benchmarks/demo_moe.md's shared-expert markers.

Usage: python benchmarks/demo_moe/shared.py [--variants 0:16:12,384:12:8] [--windows 6]
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from demo_moe_eval import (
    QUESTIONS,
    answered_right,
    held_out_windows,
    perplexity,
    stamp,
    stamp_line,
    write_marked,
)

from hetmoe.loading.gguf import open_gguf
from hetmoe.presets.demo import smollm2_gguf, write_tokenizer
from hetmoe.presets.demo_moe import dense_llama, training_windows
from hetmoe.presets.moefication import MoEficationConfig, MoEfied, collect, moefy

SCRIPT = "benchmarks/demo_moe/shared.py"


def masked_mlp(mlp: Any, x: torch.Tensor, owner: torch.Tensor, router: torch.Tensor,
               down: torch.Tensor, top_k: int) -> torch.Tensor:
    """The MoEfied MLP on x [B, T, H]: the shared neurons (owner == E) and each token's top-k
    experts' neurons (owner [I] = expert id) kept, through the refit down [H, I]."""
    a = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [B, T, I]
    logits = x @ router.T  # [B, T, E]
    picked = torch.zeros(*logits.shape[:-1], logits.shape[-1] + 1)
    picked.scatter_(-1, logits.topk(top_k, dim=-1).indices, 1.0)
    picked[..., -1] = 1.0  # the shared expert
    return (a * picked[..., owner]) @ down.T


def patch(model: Any, fit: MoEfied, top_k: int) -> None:
    """Every layer's MLP replaced by its MoEfied version (`restore` undoes it)."""
    for i, layer in enumerate(model.model.layers):
        num_experts, size = fit.groups[i].shape
        owner = torch.full((num_experts * size + len(fit.shared[i]),), num_experts)  # [I]
        owner[fit.groups[i].flatten()] = torch.arange(num_experts).repeat_interleave(size)
        layer.mlp.forward = functools.partial(masked_mlp, layer.mlp, owner=owner,
                                              router=fit.routers[i], down=fit.downs[i],
                                              top_k=top_k)


def restore(model: Any) -> None:
    for layer in model.model.layers:
        del layer.mlp.forward  # the instance attribute: the class's forward again


def logits_of(model: Any) -> Callable[[list[int]], torch.Tensor]:
    """The logits [T, V] of one window under a transformers causal LM."""
    return lambda ids: model(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def replies(model: Any, tokenizer: Any, questions: list[str], max_new: int) -> list[str]:
    """Greedy chat replies (max_new tokens at most), one question at a time."""
    out = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    gguf = open_gguf(smollm2_gguf())
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp), gguf)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp)
    tensors = dict(gguf.llama_tensors())
    model = dense_llama(gguf.llama_config(), tensors)
    windows, _ = training_windows(model, tokenizer)
    acts = collect(model, windows)
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]
    common = time.perf_counter() - start
    print(f"corpus and activations: {common:.0f} s", flush=True)
    held = held_out_windows(tokenizer.encode, args.window, args.windows)
    all_q = list(range(len(QUESTIONS)))
    kept = answered_right(all_q, replies(model, tokenizer, [q for q, _ in QUESTIONS],
                                         args.max_new_tokens))
    result: dict[str, Any] = {"dense_ppl": perplexity(logits_of(model), held), "common_s": common,
                              "questions": [QUESTIONS[q][0] for q in kept], "rows": []}
    print(f"dense ppl {result['dense_ppl']:.3f}, {len(kept)} questions right", flush=True)
    for shared, experts, top_k in args.variants:
        config = MoEficationConfig(num_experts=experts, top_k=top_k, shared_neurons=shared)
        start = time.perf_counter()
        fit = moefy(acts, downs, config)
        fit_s = time.perf_counter() - start
        patch(model, fit, top_k)
        ppl = perplexity(logits_of(model), held)
        texts = replies(model, tokenizer, result["questions"], args.max_new_tokens)
        restore(model)
        active = shared + top_k * (downs[0].shape[1] - shared) // experts
        row = {"shared": shared, "experts": experts, "top_k": top_k,
               "neurons": active / downs[0].shape[1], "ppl": ppl,
               "right": len(answered_right(kept, texts)), "recall": fit.recall, "fit_s": fit_s,
               "replies": texts}
        result["rows"].append(row)
        print(f"S={shared} E={experts} k={top_k}: ppl {ppl:.3f} "
              f"({ppl / result['dense_ppl'] - 1:+.1%}), {row['right']}/{len(kept)} right, "
              f"recall {fit.recall:.3f}, fit {fit_s:.0f} s", flush=True)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| shared neurons | routed experts x neurons | top-k | neurons per token "
             "| perplexity | vs dense | exact match | router recall | fit time |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| dense `demo` | - | - | 100 % | {result['dense_ppl']:.3f} | - "
             f"| {len(result['questions'])} / {len(result['questions'])} | - | - |"]
    for r in result["rows"]:
        size = (1536 - r["shared"]) // r["experts"]
        lines.append(f"| {r['shared']} | {r['experts']} x {size} | {r['top_k']} "
                     f"| {r['neurons']:.0%} | {r['ppl']:.2f} "
                     f"| {r['ppl'] / result['dense_ppl'] - 1:+.0%} "
                     f"| {r['right']} / {len(result['questions'])} | {r['recall']:.2f} "
                     f"| {r['fit_s']:.0f} s |")
    return "\n".join(lines)


def variant(text: str) -> tuple[int, int, int]:
    shared, experts, top_k = (int(v) for v in text.split(":"))
    return shared, experts, top_k


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=lambda v: [variant(x) for x in v.split(",")],
                        default=[(0, 16, 12), (384, 12, 8), (512, 16, 10)],
                        help="shared:experts:top_k, comma-separated")
    parser.add_argument("--windows", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = measure(args)
    result.update(stamp(__file__, argv))
    print(table(result))
    (args.out / "demo_moe_shared.json").write_text(json.dumps(result, indent=1) + "\n")
    header = stamp_line(result, f"corpus and activations {result['common_s']:.0f} s")
    write_marked(args.out / "demo_moe.md", "shared", SCRIPT, f"{header}\n\n{table(result)}")
    return result


if __name__ == "__main__":
    main()
