"""`hetmoe sft MODEL DATA --out ADAPTER`: LoRA fine-tuning on the machine that runs the model
(cli.py registers the command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hetmoe.cli_exit import fail, load_llm
from hetmoe.train.lora import LoraSettings
from hetmoe.train.sft_config import SftConfig

# Commands import what they run inside their functions: `hetmoe --help` imports none of torch,
# transformers, rich, httpx, the engine or the loaders (tests/test_cli_basics.py).

_SFT = SftConfig()
_LORA = LoraSettings()


def sft(
    model: Annotated[str, typer.Argument(help="Checkpoint directory, converted directory or "
                                              "preset")],
    data: Annotated[Path, typer.Argument(
        help="JSONL: one {\"messages\": [{role, content}, ...]} or {\"prompt\", \"completion\"} "
             "per line")],
    out: Annotated[Path, typer.Option(help="Adapter directory to write (PEFT format)")],
    seq_len: Annotated[int, typer.Option(help="Tokens per packed row")] = _SFT.seq_len,
    epochs: Annotated[int, typer.Option(help="Passes over DATA")] = _SFT.epochs,
    max_steps: Annotated[int | None, typer.Option(
        help="Optimizer steps (overrides --epochs)")] = None,
    grad_accum: Annotated[int, typer.Option(help="Rows per optimizer step")] = _SFT.grad_accum,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW)")] = _SFT.lr,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay")] = _SFT.weight_decay,
    warmup_steps: Annotated[int, typer.Option(
        help="Linear warmup steps, then cosine decay")] = _SFT.warmup_steps,
    max_grad_norm: Annotated[float, typer.Option(
        help="Gradient clipping (0 = off)")] = _SFT.max_grad_norm,
    rank: Annotated[int, typer.Option(help="LoRA rank")] = _LORA.rank,
    alpha: Annotated[int, typer.Option(help="LoRA alpha")] = _LORA.alpha,
    dropout: Annotated[float, typer.Option(help="LoRA dropout")] = _LORA.dropout,
    targets: Annotated[str | None, typer.Option(
        help="PEFT target_modules regex (default: attention projections and shared experts)")
    ] = None,
    seed: Annotated[int, typer.Option(help="Adapter init and data order seed")] = _SFT.seed,
    save_every: Annotated[int, typer.Option(
        help="Steps between resumable checkpoints (0 = none)")] = _SFT.save_every,
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient-checkpointing", help="Recompute layers in backward (less memory)")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in --out")] = False,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N")] = None,
    experts: Annotated[str | None, typer.Option(help="Routed-expert backend: cpu or torch")
                       ] = None,
) -> None:
    """Fine-tune a LoRA adapter on DATA.

    Loss on the assistant's tokens only (the chat template renders each example); short
    samples are packed into rows without attention across them. bf16 on a GPU, fp32 on the
    CPU. Writes the adapter, checkpoints, train_log.json and loss.png into --out.
    """
    from hetmoe.engine.model.model_setup import check_device
    from hetmoe.train.data import build_rows, check_file
    from hetmoe.train.report import TrainProgress
    from hetmoe.train.sft import train

    try:
        lora = LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets)
        config = SftConfig(seq_len=seq_len, epochs=epochs, max_steps=max_steps,
                           grad_accum=grad_accum, lr=lr, weight_decay=weight_decay,
                           warmup_steps=warmup_steps, max_grad_norm=max_grad_norm, seed=seed,
                           save_every=save_every, gradient_checkpointing=gradient_checkpointing,
                           lora=lora)
        examples = check_file(data)
        chosen = check_device(device)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file; give a directory")
    except (ValueError, FileNotFoundError) as exc:
        fail(exc)
    dtype = "bfloat16" if chosen.type == "cuda" else "float32"
    llm = load_llm(model, str(chosen), None, dtype=dtype, experts=experts, max_batch=1,
                   max_seq_len=seq_len)
    try:
        rows, cut = build_rows(data, llm.tokenizer, seq_len)
        total = config.total_steps(len(rows))
        typer.echo(f"{examples} examples in {len(rows)} rows of <= {seq_len} tokens"
                   f"{f' ({cut} cut to --seq-len)' if cut else ''}; {total} steps", err=True)
        out.mkdir(parents=True, exist_ok=True)
        with TrainProgress(total) as progress:
            result = train(llm.model, rows, config, out, resume, progress)
    except (ValueError, FileNotFoundError) as exc:
        fail(exc)
    history = result.history
    summary = {"model": model, "data": str(data), "examples": examples, "rows": len(rows),
               "cut": cut, "device": str(chosen), "dtype": dtype, "config": config.record(),
               "resumed_from": result.resumed_from,
               "tokens_per_s": sum(s.tokens for s in history) / max(
                   sum(s.seconds for s in history), 1e-9)}
    _write_report(out, model, history, summary)


def _write_report(out: Path, model: str, history: list[Any], summary: dict[str, Any]) -> None:
    """train_log.json and loss.png in `out`, and a line naming them and the final loss."""
    from hetmoe.train.report import plot_loss, write_log

    write_log(out / "train_log.json", history, summary)
    plot_loss(out / "loss.png", history, f"hetmoe sft {model}")
    last = history[-1].loss if history else float("nan")
    typer.echo(f"adapter in {out} (final loss {last:.4f}); log: {out / 'train_log.json'}, "
               f"curve: {out / 'loss.png'}")
