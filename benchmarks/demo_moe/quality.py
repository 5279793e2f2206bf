"""What learned sparse routing and Expert Deferral cost in answers, on `demo-moe` against `demo`.

Measures, on the CPU with torch experts in fp32 (exact arithmetic; what the GPU would compute):
- perplexity on the held-out documentation topics (`demo_moe_corpus.held_out_texts`, never read
  by the build) and greedy exact match on QUESTIONS (kept: those dense `demo` answers right);
- Expert Deferral vs skipping the same lowest-scored experts, for 0 .. k-2 affected experts,
  through the engine's own MoE step (`MoEStep`, `BackendLink`): skipping drops the deferred
  slots' output, deferral adds it to the next MoE layer. Answers prefill exactly and defer in
  decode steps, as the engine does; perplexity defers at every position (each token as if
  decoded);
- the "misses" deferral order (`EngineConfig.defer_order`) at each `--resident-share`: the most
  routed experts of each layer resident (counted on the build's training text, never the
  held-out text), each token deferring its lowest-scored min(d, misses) non-resident experts;
- routing statistics per layer on the held-out text (skew, Gini, LRU/LFU hit rates).
Writes JSON, a PNG, and the tables into docs/benchmarks/demo_moe.md between its table markers.

Usage: python benchmarks/demo_moe/quality.py [--windows 6] [--window 512] [--max-new-tokens 16]
                                             [--affected 0,2,4] [--resident-share 0.5,0.75]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from demo_moe_eval import (
    QUESTIONS,
    answered_right,
    exact_match,
    held_out_windows,
    markers,
    perplexity,
    record_picks,
    stamp,
    stamp_line,
    write_marked,
)
from routing import routing_stats, routing_table

from hetmoe import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.ops.deferral import deferred_misses
from hetmoe.ops.moe import moe_layers
from hetmoe.ops.moe_step import BackendLink, MoEStep
from hetmoe.presets import resolve_model
from hetmoe.presets.demo_moe_corpus import token_windows, train_texts

SCRIPT = "benchmarks/demo_moe/quality.py"


class SkipLink(BackendLink):
    """Computes the deferred slots like `BackendLink` and drops their output: skipping."""

    def finish_late(self) -> torch.Tensor:
        return torch.zeros_like(super().finish_late())


class MissesLink(BackendLink):
    """Defers the "misses" order's set (ops/deferral.py) of a layer whose `resident` [E] bool
    experts would be on the GPU; counts the (token, expert) pairs it defers."""

    def __init__(self, moe: Any, resident: torch.Tensor) -> None:
        super().__init__(moe.experts, moe.experts.spec.hidden_size, moe.gate.config.top_k)
        self.resident = resident
        self.deferred_pairs = self.tokens = 0

    def split(self, ids: torch.Tensor, deferred: int) -> tuple[torch.Tensor, torch.Tensor]:
        late = deferred_misses(~self.resident[ids], deferred)  # [T, K]
        self.deferred_pairs += int(late.sum())
        self.tokens += ids.shape[0]
        return torch.where(late, -1, ids), torch.where(late, ids, -1)


@contextmanager
def attached(llm: LLM, mode: str, affected: int,
             resident: list[torch.Tensor] | None = None) -> Iterator[MoEStep]:
    """The engine's MoE step on every layer: `affected` experts deferred (mode "defer"),
    skipped (mode "skip"), or at most that many of each token's misses deferred (mode "defer
    misses", `resident` [E] bool per layer)."""
    layers = moe_layers(llm.model)
    links: list[BackendLink]
    if mode == "defer misses":
        assert resident is not None
        links = [MissesLink(m, r) for m, r in zip(layers, resident, strict=True)]
    else:
        link = SkipLink if mode == "skip" else BackendLink
        links = [link(m.experts, m.experts.spec.hidden_size, m.gate.config.top_k)
                 for m in layers]
    step = MoEStep(layers, lambda i: links[i], affected)
    step.attach()
    try:
        yield step
    finally:
        step.detach()


@torch.inference_mode()
def perplexity_kl(runner: ModelRunner, windows: list[list[int]], step: MoEStep,
                  exact: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """Held-out perplexity with every position in decode phase (each token as if decoded), and
    the mean KL(exact || this) of the next-token distributions against `exact` (per window
    log-probs [T, V]; appended to when empty: the exact pass records them)."""
    kl, count = 0.0, 0
    record = exact is not None and not exact

    def logits_of(ids: list[int]) -> torch.Tensor:
        runner.lengths[0] = 0
        with step.phase(decoding=True):
            return runner.prefill_logits(0, ids)  # [T, V]

    def against_exact(w: int, logp: torch.Tensor) -> None:
        nonlocal kl, count
        count += logp.shape[0] - 1
        if exact is None:
            return
        if record:
            exact.append(logp.half())
        ref = exact[w].float()
        kl += (ref.exp() * (ref - logp)).sum(-1)[:-1].sum().item()

    ppl = perplexity(logits_of, windows, against_exact)
    return ppl, kl / count


@torch.inference_mode()
def answers(llm: LLM, runner: ModelRunner, questions: list[str], step: MoEStep,
            max_new: int) -> list[str]:
    """Greedy replies, one slot per question: each prefilled exactly, then decoded together
    in decode phase (deferral applies)."""
    logits = []
    for slot, question in enumerate(questions):
        runner.lengths[slot] = 0
        ids = llm.chat_prompt([{"role": "user", "content": question}])
        logits.append(runner.prefill(slot, ids))
    replies: list[list[int]] = [[] for _ in questions]
    active = list(range(len(questions)))
    for _ in range(max_new):
        tokens = [int(logits[slot].argmax()) for slot in active]
        active = [s for s, t in zip(active, tokens, strict=True) if t not in llm.eos_token_ids]
        tokens = [t for t in tokens if t not in llm.eos_token_ids]
        for slot, token in zip(active, tokens, strict=True):
            replies[slot].append(token)
        if not active:
            break
        with step.phase(decoding=True):
            out = runner.decode(active, tokens)  # [B, V]
        for row, slot in enumerate(active):
            logits[slot] = out[row]
    return [llm.decode(r) for r in replies]


def ask(llm: LLM, runner: ModelRunner, step: MoEStep, questions: list[int],
        max_new: int) -> tuple[float, list[str]]:
    """Exact match over `questions` (indices into QUESTIONS), and the replies."""
    replies = answers(llm, runner, [QUESTIONS[q][0] for q in questions], step, max_new)
    return exact_match(questions, replies), replies


def resident_sets(llm: LLM, runner: ModelRunner, window: int, count: int,
                  shares: list[float]) -> dict[float, list[torch.Tensor]]:
    """Per share, [E] bool per MoE layer: its round(share E) most routed experts over `count`
    training windows of the build's corpus (never the held-out text)."""
    train = token_windows([llm.encode(t) for t in train_texts()], window, count)
    picks = record_picks(llm, runner, train)  # [N, K] per layer
    experts = moe_layers(llm.model)[0].experts.spec.num_experts
    ranked = [torch.bincount(p.flatten(), minlength=experts).argsort(descending=True)
              for p in picks]
    out = {}
    for share in shares:
        masks = [torch.zeros(experts, dtype=torch.bool) for _ in ranked]
        for mask, order in zip(masks, ranked, strict=True):
            mask[order[:round(share * experts)]] = True
        out[share] = masks
    return out


def load(name: str, max_seq_len: int) -> tuple[LLM, ModelRunner]:
    llm = LLM(resolve_model(name), device="cpu", dtype="float32", experts="torch",
              progress=False, max_seq_len=max_seq_len)
    return llm, ModelRunner(llm.model, llm.device, llm.dtype, len(QUESTIONS), max_seq_len)


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    dense, dense_runner = load("demo", args.window)
    windows = held_out_windows(dense.encode, args.window, args.windows)
    result: dict[str, Any] = {"held_out_tokens": sum(len(w) for w in windows)}
    with attached(dense, "defer", 0) as step:
        result["dense_ppl"] = perplexity_kl(dense_runner, windows, step)[0]
        log(f"dense ppl {result['dense_ppl']:.3f}")
        all_q = list(range(len(QUESTIONS)))
        _, replies = ask(dense, dense_runner, step, all_q, args.max_new_tokens)
    kept = answered_right(all_q, replies)
    result["dense_replies"] = {QUESTIONS[q][0]: replies[q] for q in all_q}
    result["questions"] = [QUESTIONS[q][0] for q in kept]
    log(f"dense answers {len(kept)}/{len(all_q)} right; those are the question set")
    moe, runner = load("demo-moe", args.window)
    top_k = moe_layers(moe.model)[0].gate.config.top_k
    rows = []
    exact: list[torch.Tensor] = []  # the exact MoE's log-probs, for the KL of each variant
    affected_counts = args.affected if args.affected is not None else list(range(top_k - 1))
    shares = resident_sets(moe, runner, args.window, args.train_windows, args.resident_share)
    variants = [(a, m, None) for a in affected_counts
                for m in (("defer", "skip") if a else ("exact",))]
    variants += [(a, "defer misses", s) for s in args.resident_share for a in affected_counts if a]
    for affected, mode, share in variants:
        with attached(moe, mode, affected, shares.get(share)) as step:
            start = time.perf_counter()
            ppl, kl = perplexity_kl(runner, windows, step, exact)
            per_token = _deferred_per_token(step)  # the perplexity pass's, before the answers
            em, replies = ask(moe, runner, step, kept, args.max_new_tokens)
        rows.append({"mode": mode, "affected": affected, "resident_share": share,
                     "deferred_per_token": per_token, "ppl": ppl, "kl": kl,
                     "exact_match": em, "replies": replies})
        log(f"{mode} {affected} ({share or 0:.0%} resident): ppl {ppl:.3f} "
            f"({ppl / result['dense_ppl'] - 1:+.1%}), KL {kl:.3f}, exact match {em:.0%}, "
            f"{per_token:.2f} deferred per token ({time.perf_counter() - start:.0f} s)")
    result["rows"] = rows
    result["top_k"] = top_k
    result["routing"] = routing_stats(moe, runner, windows)
    return result


def _deferred_per_token(step: MoEStep) -> float:
    """Mean (token, expert) pairs deferred per token and MoE layer: measured for "defer misses"
    (the perplexity pass), the count itself otherwise."""
    links = [step.links(i) for i in range(len(step.layers))]
    if not all(isinstance(link, MissesLink) for link in links):
        return float(step.deferred)
    counted = [link for link in links if isinstance(link, MissesLink) and link.tokens]
    return sum(link.deferred_pairs / link.tokens for link in counted) / max(len(counted), 1)


def deferral_table(result: dict[str, Any]) -> str:
    lines = ["| experts affected (d) | mode | resident share | deferred per token | perplexity "
             "| vs dense | KL vs exact MoE | exact match |",
             "|---:|---|---:|---:|---:|---:|---:|---:|",
             f"| dense `demo` | - | - | - | {result['dense_ppl']:.3f} | - | - | 100 % |"]
    for row in result["rows"]:
        share = row.get("resident_share")
        per_token = row.get("deferred_per_token", row["affected"])
        lines.append(f"| {row['affected']} | {row['mode']} "
                     f"| {'-' if share is None else f'{share:.0%}'} | {per_token:.2f} "
                     f"| {row['ppl']:.4g} | {row['ppl'] / result['dense_ppl'] - 1:+.0%} "
                     f"| {row['kl']:.3f} | {row['exact_match']:.0%} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    exact = next(r for r in result["rows"] if r["mode"] == "exact")
    shares = sorted({r["resident_share"] for r in result["rows"]
                     if r.get("resident_share") is not None})
    curves = [("defer", None, "o-"), ("skip", None, "s--"),
              *(("defer misses", s, "^:") for s in shares)]
    for mode, share, style in curves:
        rows = [exact] + [r for r in result["rows"]
                          if r["mode"] == mode and r.get("resident_share") == share]
        label = mode if share is None else f"{mode}, {share:.0%} resident"
        xs = [r["affected"] for r in rows]
        left.plot(xs, [r["ppl"] for r in rows], style, label=label)
        right.plot(xs, [100 * r["exact_match"] for r in rows], style, label=label)
    left.axhline(result["dense_ppl"], color="gray", linestyle=":", label="dense demo")
    right.axhline(100, color="gray", linestyle=":", label="dense demo")
    xlabel = f"experts affected, d (of top-{result['top_k']})"
    left.set(xlabel=xlabel, ylabel="held-out perplexity (log scale)", title="perplexity",
             yscale="log")
    right.set(xlabel=xlabel, ylabel="exact match, % of dense's right answers", title="exact match")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_doc(doc: Path, result: dict[str, Any]) -> None:
    """Replaces the text between the doc's table markers (the prose around them is kept)."""
    if not doc.exists():
        begin, end = markers("tables", SCRIPT)
        doc.write_text(f"# demo-moe\n\n{begin}\n{end}\n")
    line = stamp_line(result, f"{result['held_out_tokens']} held-out tokens, "
                              f"{len(result['questions'])} questions")
    body = (f"{line}\n\n{deferral_table(result)}\n\n"
            f"![deferral vs skipping](demo_moe_deferral.png)\n\n{routing_table(result['routing'])}")
    write_marked(doc, "tables", SCRIPT, body)


def resident_shares(value: str) -> list[float]:
    """`--resident-share`: shares in [0, 1], comma-separated ('': none)."""
    shares = [float(x) for x in value.split(",") if x]
    bad = [x for x in shares if not 0.0 <= x <= 1.0]
    if bad:  # a negative one would slice the ranking from its end
        raise argparse.ArgumentTypeError(f"shares are in [0, 1], got {', '.join(map(str, bad))}")
    return shares


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="held-out windows")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--affected", type=lambda v: [int(x) for x in v.split(",")],
                        help="experts affected, e.g. 0,2,4 (default: 0 .. top_k - 2)")
    parser.add_argument("--resident-share", type=resident_shares, default=[0.5, 0.75],
                        help="shares of each layer's experts resident for the 'defer misses' "
                        "rows, e.g. 0.5,0.75 ('': none)")
    parser.add_argument("--train-windows", type=int, default=24,
                        help="training windows whose routing ranks the resident experts")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    result = measure(args, lambda line: print(line, flush=True))
    result.update(stamp(__file__, argv))
    print(deferral_table(result))
    print(routing_table(result["routing"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_moe.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "demo_moe_deferral.png")
    write_doc(args.out / "demo_moe.md", result)
    return result


if __name__ == "__main__":
    main()
