"""Does an always-on shared expert make a better `demo-moe`? MoEfication variants compared at
the same share of neurons per token, each computed by masking the dense model's neurons (the
checkpoint's math with routing weights exactly 1; Mixtral's or Qwen2-MoE's stored weights are
1/top-k within a few percent and the down projections scaled by top-k).

Per variant (shared neurons S, routed experts E, top-k): the build's own steps
(`moefication.moefy`: the S neurons of largest mean |activation| always on, the rest clustered
into E experts, routers trained, down refit) on the build's corpus (`demo_moe.training_windows`,
collected once), then held-out perplexity on the same windows as `demo_moe_quality.py` and
greedy exact match on its questions (those dense `demo` answers right). Writes JSON and the table
between docs/benchmarks/demo_moe.md's shared-expert markers.

Usage: python benchmarks/demo_moe_shared.py [--variants 0:16:12,384:12:8] [--windows 6]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from demo_moe_quality import QUESTIONS  # noqa: E402
from demo_moe_routing import replace_marked  # noqa: E402

from hetmoe.loading.gguf import open_gguf  # noqa: E402
from hetmoe.machine import cpu_model, source_commit  # noqa: E402
from hetmoe.presets.demo import smollm2_gguf, write_tokenizer  # noqa: E402
from hetmoe.presets.demo_moe import dense_llama, training_windows  # noqa: E402
from hetmoe.presets.demo_moe_corpus import held_out_texts, token_windows  # noqa: E402
from hetmoe.presets.moefication import MoEficationConfig, MoEfied, collect, moefy  # noqa: E402


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


@torch.inference_mode()
def perplexity(model: Any, windows: list[list[int]]) -> float:
    """exp(mean NLL) of every next token of `windows` (one forward per window)."""
    nll, count = 0.0, 0
    for ids in windows:
        logits = model(torch.tensor([ids])).logits[0]  # [T, V]
        nll += F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


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


def right(questions: list[int], texts: list[str]) -> list[int]:
    return [q for q, t in zip(questions, texts, strict=True)
            if any(a in t.lower() for a in QUESTIONS[q][1])]


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
    held = token_windows([tokenizer.encode(t) for t in held_out_texts()], args.window,
                         args.windows)
    all_q = list(range(len(QUESTIONS)))
    kept = right(all_q, replies(model, tokenizer, [q for q, _ in QUESTIONS], args.max_new_tokens))
    result: dict[str, Any] = {"dense_ppl": perplexity(model, held), "common_s": common,
                              "questions": [QUESTIONS[q][0] for q in kept], "rows": []}
    print(f"dense ppl {result['dense_ppl']:.3f}, {len(kept)} questions right", flush=True)
    for shared, experts, top_k in args.variants:
        config = MoEficationConfig(num_experts=experts, top_k=top_k, shared_neurons=shared)
        start = time.perf_counter()
        fit = moefy(acts, downs, config)
        fit_s = time.perf_counter() - start
        patch(model, fit, top_k)
        ppl = perplexity(model, held)
        texts = replies(model, tokenizer, result["questions"], args.max_new_tokens)
        restore(model)
        active = shared + top_k * (downs[0].shape[1] - shared) // experts
        row = {"shared": shared, "experts": experts, "top_k": top_k,
               "neurons": active / downs[0].shape[1], "ppl": ppl,
               "right": len(right(kept, texts)), "recall": fit.recall, "fit_s": fit_s,
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
    command = "python benchmarks/demo_moe_shared.py " + " ".join(argv or sys.argv[1:])
    result.update(command=command.strip(), date=time.strftime("%Y-%m-%d", time.gmtime()),
                  machine=f"{cpu_model()}, {torch.get_num_threads()} torch threads",
                  git=source_commit(Path(__file__).resolve().parents[1]))
    print(table(result))
    (args.out / "demo_moe_shared.json").write_text(json.dumps(result, indent=1) + "\n")
    header = (f"`{result['command']}` ({result['date']}, {result['machine']}, git "
              f"{result['git']}; corpus and activations {result['common_s']:.0f} s)")
    replace_marked(args.out / "demo_moe.md", "shared",
                   "<!-- shared: written by benchmarks/demo_moe_shared.py -->",
                   "<!-- /shared -->", f"{header}\n\n{table(result)}")
    return result


if __name__ == "__main__":
    main()
