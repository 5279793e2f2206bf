"""PEFT + transformers as the outside oracle of `hetmoe sft` on real text: `demo` (SmolLM2-135M-
Instruct as a Mixtral whose 8 experts are slices of the dense MLP) trained by `hetmoe sft` must
follow the loss curve of the dense SmolLM2 trained with PEFT in a plain torch loop on the same
rows, seed, LoRA config, AdamW, cosine schedule and batch order, and the adapter hetmoe wrote must
give the same greedy answer in `LLM("demo", lora=...)` as in PEFT on the dense model.

    python benchmarks/training/oracle_sft_demo.py [--steps 50] [--seq-len 256] [--grad-accum 2]
                                         [--json out.json] [--png out.png]

Both sides run fp32 on the CPU. The CPU backend packs expert weights as bf16, so the reference's
MLP weights are rounded to bf16 (exact: the demo's 8x-scaled down slices round as the dense rows
do); everything else is the dense model as transformers' own GGUF loader builds it. The reference
loop is plain torch (no Trainer): its own loss (summed cross entropy over the step's labeled
tokens / their count), torch's AdamW, a LambdaLR written from the schedule's formula, and the
rows `hetmoe.train.data.build_rows` makes with transformers' GGUF tokenizer (checked equal to the
demo tokenizer's rows), taken in `hetmoe.train.sft`'s data order.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetmoe.machine import machine_report, source_commit
from hetmoe.train.data import IGNORE, Row, build_rows

QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]
"""Held out of the data: the greedy answer both sides must agree on."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""LoRA targets of the reference (the dense model has no shared experts)."""

_CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"),
             ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("Canada", "Ottawa"),
             ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
             ("Greece", "Athens"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
             ("Sweden", "Stockholm"), ("Ireland", "Dublin"), ("Chile", "Santiago")]
_SUMS = [(2, 3), (7, 5), (12, 9), (20, 22), (31, 14), (8, 8), (45, 10), (17, 26)]
_COLORS = [("the sky on a clear day", "blue"), ("fresh grass", "green"), ("snow", "white"),
           ("a ripe banana", "yellow"), ("coal", "black"), ("a ripe tomato", "red"),
           ("an orange", "orange"), ("a flamingo", "pink")]


def instruction_examples() -> list[dict[str, Any]]:
    """40 chat examples whose replies share one style (upper case, a fixed lead-in), so that
    a tuned adapter visibly changes the answers; fully deterministic."""
    examples = [(f"What is the capital of {c}?", f"ANSWER: THE CAPITAL OF {c} IS {k}.")
                for c, k in _CAPITALS]
    examples += [(f"What is {a} plus {b}?", f"ANSWER: {a} PLUS {b} IS {a + b}.")
                 for a, b in _SUMS]
    examples += [(f"What color is {t}?", f"ANSWER: {t} IS {k}.") for t, k in _COLORS]
    examples += [(f"Name the country whose capital is {k}.", f"ANSWER: {k} IS THE CAPITAL OF {c}.")
                 for c, k in _CAPITALS[:8]]
    return [{"messages": [{"role": "user", "content": q},
                          {"role": "assistant", "content": a.upper()}]} for q, a in examples]


def write_data(path: Path) -> Path:
    """The instruction file as JSONL of chat `messages`."""
    path.write_text("".join(json.dumps(e) + "\n" for e in instruction_examples()))
    return path


@dataclass(frozen=True)
class Settings:
    """Hyper-parameters shared by both sides (LoRA: rank, alpha, no dropout)."""

    steps: int = 50
    seq_len: int = 256
    grad_accum: int = 2
    lr: float = 5e-4
    warmup_steps: int = 5
    seed: int = 0
    rank: int = 16
    alpha: int = 32

    def sft_args(self) -> list[str]:
        """The same settings as `hetmoe sft` options."""
        return ["--max-steps", str(self.steps), "--seq-len", str(self.seq_len),
                "--grad-accum", str(self.grad_accum), "--lr", str(self.lr),
                "--warmup-steps", str(self.warmup_steps), "--seed", str(self.seed),
                "--rank", str(self.rank), "--alpha", str(self.alpha), "--save-every", "0"]


@dataclass(frozen=True)
class Curve:
    """Per step: loss, learning rate, tokens; and the run's wall time."""

    loss: list[float]
    lr: list[float]
    tokens: list[int]
    seconds: float


def run_hetmoe_sft(demo: Path, data: Path, out: Path, settings: Settings) -> Curve:
    """`hetmoe sft DEMO DATA --out OUT` (fp32 on the CPU, CPU experts) in this process; its
    train_log.json as a curve."""
    from typer.testing import CliRunner

    from hetmoe.cli import app

    began = time.perf_counter()
    args = ["sft", str(demo), str(data), "--out", str(out), "--device", "cpu",
            "--experts", "cpu", *settings.sft_args()]
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise RuntimeError(f"hetmoe sft failed ({result.exit_code}): {result.output[-2000:]}"
                           ) from result.exception
    steps = json.loads((out / "train_log.json").read_text())["steps"]
    return Curve([s["loss"] for s in steps], [s["lr"] for s in steps],
                 [s["tokens"] for s in steps], time.perf_counter() - began)


def bf16_mlp(dense: nn.Module) -> nn.Module:
    """A copy of the dense model with its MLP weights rounded to bf16 as the CPU backend packs
    the demo's experts (the copy keeps the caller's model free of LoRA layers)."""
    model = copy.deepcopy(dense)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.copy_(p.bfloat16().float())
    return model


def cosine_lambda(warmup: int, total: int) -> Any:
    """LR factor of step s: linear warmup, then half a cosine to 0."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor


def run_reference(dense: nn.Module, rows: list[Row], settings: Settings) -> tuple[Curve, Any]:
    """PEFT LoRA on the dense transformers model in a plain torch loop; (curve, peft model)."""
    from peft import LoraConfig, get_peft_model

    from hetmoe.train.sft import _Order  # the data order of `train`: same rows per step

    began = time.perf_counter()
    torch.manual_seed(settings.seed)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0,
                        target_modules=TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(bf16_mlp(dense), config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_lambda(settings.warmup_steps, settings.steps))
    order = _Order(len(rows), settings.seed)
    losses: list[float] = []
    lrs: list[float] = []
    tokens: list[int] = []
    for step in range(settings.steps):
        batch = [rows[order(step * settings.grad_accum + j)] for j in range(settings.grad_accum)]
        # [1, L] per row; the loss of position t predicts token t+1
        labeled = sum(sum(v != IGNORE for v in r.labels[1:]) for r in batch)
        total = 0.0
        for row in batch:
            ids = torch.tensor([row.input_ids])
            logits = model(input_ids=ids, position_ids=torch.tensor([row.position_ids]),
                           use_cache=False).logits[0, :-1]  # [L-1, V]
            loss = nn.functional.cross_entropy(logits.float(), torch.tensor(row.labels[1:]),
                                               ignore_index=IGNORE, reduction="sum") / labeled
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        lrs.append(float(schedule.get_last_lr()[0]))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        tokens.append(sum(len(r.input_ids) for r in batch))
    return Curve(losses, lrs, tokens, time.perf_counter() - began), model.eval()


def gguf_tokenizer(gguf_path: Path) -> Any:
    """SmolLM2's tokenizer as transformers reads it from the GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@dataclass(frozen=True)
class Agreement:
    """How closely the two runs agree."""

    steps: int
    first_loss_rel: float
    """|Δloss| / loss of step 1 (no adapter update yet: the models' forward)."""
    early_loss_rel: float
    """Largest |Δloss| / loss over the first 5 steps."""
    max_loss_rel: float
    """Largest |Δloss| / loss over all steps."""
    lr_max_abs: float
    """Largest |Δlr| (the schedules)."""
    adapter_rel: float
    """‖Δ‖ / ‖·‖ of the final adapter weights (all LoRA tensors together)."""
    answer_hetmoe: str
    answer_reference: str
    answer_base: str
    greedy_equal: bool


def compare(ours: Curve, ref: Curve, adapter: Path, ref_model: Any) -> dict[str, float]:
    """Curve and adapter agreement (ratios relative to the reference)."""
    from safetensors.torch import load_file

    rel = [abs(a - b) / abs(b) for a, b in zip(ours.loss, ref.loss, strict=True)]
    mine = load_file(str(adapter / "adapter_model.safetensors"))
    theirs = {k.replace(".default", ""): v.detach() for k, v in ref_model.state_dict().items()
              if "lora_" in k}
    if set(mine) != set(theirs):
        raise ValueError(f"adapter tensors differ: {sorted(set(mine) ^ set(theirs))[:4]}")
    diff = math.sqrt(sum(float((mine[k] - theirs[k]).square().sum()) for k in mine))
    norm = math.sqrt(sum(float(theirs[k].square().sum()) for k in theirs))
    return {"first_loss_rel": rel[0], "early_loss_rel": max(rel[:5]), "max_loss_rel": max(rel),
            "lr_max_abs": max(abs(a - b) for a, b in zip(ours.lr, ref.lr, strict=True)),
            "adapter_rel": diff / norm}


def greedy_answers(demo: Path, adapter: Path, dense: nn.Module, tokens: int
                   ) -> tuple[list[int], list[int], list[int], Any]:
    """Greedy token ids of QUESTION: (LLM(demo, lora=adapter), the same adapter in PEFT on the
    dense model, LLM(demo) without it, hetmoe's tokenizer)."""
    from peft import PeftModel

    from hetmoe import LLM

    def llm(**kw: Any) -> LLM:
        return LLM(demo, device="cpu", dtype="float32", experts="cpu", progress=False,
                   max_batch=1, max_seq_len=256, **kw)

    tuned = llm(lora=adapter)
    ours = tuned.chat(QUESTION, max_new_tokens=tokens).token_ids
    base = llm().chat(QUESTION, max_new_tokens=tokens).token_ids
    prompt = tuned.chat_prompt(QUESTION)
    peft = PeftModel.from_pretrained(bf16_mlp(dense), str(adapter)).eval()
    tokenizer = tuned.tokenizer
    if tokenizer is None:
        raise ValueError(f"{demo} has no tokenizer")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = peft.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos)
    return ours, out[0, len(prompt):].tolist(), base, tokenizer


def plot(path: Path, ours: Curve, ref: Curve, title: str) -> None:
    """Both loss curves and their relative difference as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = list(range(1, len(ours.loss) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    top.plot(steps, ref.loss, label="PEFT + transformers, dense SmolLM2", lw=2.5, alpha=0.5)
    top.plot(steps, ours.loss, label="hetmoe sft, demo (CPU experts)", ls="--", marker=".")
    top.set_ylabel("loss (assistant tokens)")
    top.set_title(title)
    top.legend()
    bottom.semilogy(steps, [max(abs(a - b) / b, 1e-9) for a, b in zip(ours.loss, ref.loss,
                                                                       strict=True)])
    bottom.set_ylabel("|Δloss| / loss")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(demo: Path, dense: nn.Module, gguf_path: Path, work: Path, settings: Settings,
        answer_tokens: int = 24) -> tuple[Agreement, Curve, Curve]:
    """The whole oracle in `work`: data, both trainings, agreement and greedy answers."""
    from transformers import AutoTokenizer

    data = write_data(work / "instructions.jsonl")
    rows, _ = build_rows(data, gguf_tokenizer(gguf_path), settings.seq_len)
    demo_rows, _ = build_rows(data, AutoTokenizer.from_pretrained(str(demo)), settings.seq_len)
    if rows != demo_rows:
        raise ValueError("the demo tokenizer's rows differ from transformers' GGUF tokenizer's")
    ours = run_hetmoe_sft(demo, data, work / "adapter", settings)
    ref, ref_model = run_reference(dense, rows, settings)
    if ours.tokens != ref.tokens:
        raise ValueError(f"batch composition differs: tokens per step {ours.tokens} vs "
                         f"{ref.tokens}")
    numbers = compare(ours, ref, work / "adapter", ref_model)
    mine, theirs, base, tokenizer = greedy_answers(demo, work / "adapter", dense, answer_tokens)
    agreement = Agreement(settings.steps, **numbers, answer_hetmoe=tokenizer.decode(mine),
                          answer_reference=tokenizer.decode(theirs),
                          answer_base=tokenizer.decode(base), greedy_equal=mine == theirs)
    return agreement, ours, ref


def main() -> None:
    import tempfile

    from transformers.models.llama import LlamaForCausalLM

    from hetmoe.presets import resolve_model
    from hetmoe.presets.demo import smollm2_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--grad-accum", type=int, default=defaults.grad_accum)
    parser.add_argument("--json", type=Path, help="where to write the results as JSON")
    parser.add_argument("--png", type=Path, help="where to draw both loss curves")
    args = parser.parse_args()
    settings = Settings(steps=args.steps, seq_len=args.seq_len, grad_accum=args.grad_accum)
    gguf_path = smollm2_gguf()
    dense = LlamaForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                             dtype=torch.float32).eval()
    demo = resolve_model("demo")
    with tempfile.TemporaryDirectory() as work:
        agreement, ours, ref = run(demo, dense, gguf_path, Path(work), settings)
    print(f"{'step':>4} {'hetmoe':>9} {'PEFT':>9} {'rel':>9}")
    for i, (a, b) in enumerate(zip(ours.loss, ref.loss, strict=True), 1):
        print(f"{i:>4} {a:9.5f} {b:9.5f} {abs(a - b) / b:9.2e}")
    for key, value in asdict(agreement).items():
        print(f"{key}: {value}")
    print(f"wall: hetmoe sft {ours.seconds:.0f} s, reference {ref.seconds:.0f} s")
    if args.png:
        plot(args.png, ours, ref, f"LoRA SFT on demo vs dense SmolLM2 ({settings.steps} steps)")
    if args.json:
        sha = source_commit(Path(__file__).resolve().parents[2])
        import peft

        record = {"date": time.strftime("%Y-%m-%d"), "commit": sha, "machine": machine_report(),
                  "peft": peft.__version__, "model": "demo", "settings": asdict(settings),
                  "agreement": asdict(agreement), "hetmoe": asdict(ours),
                  "reference": asdict(ref)}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
