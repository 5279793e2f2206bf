"""The SFT loop: LoRA (peft) on a loaded hetmoe model with its routed experts frozen in the CPU
backend; AdamW, transformers' cosine schedule with warmup, gradient accumulation, optional
gradient checkpointing, resumable checkpoints (train/checkpoint.py).

Micro-batches are packed rows (train/data.py), one per forward. Their order is one endless
stream of per-epoch permutations seeded by (seed, epoch); step s trains micro-batches
s*accum ... s*accum + accum - 1 of it, so the step is the whole data position. A step's loss is
the mean over all its rows' labeled tokens (`num_items_in_batch`), not a mean of row means.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import get_cosine_schedule_with_warmup

from hetmoe.train.checkpoint import (
    TrainerState,
    fingerprint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hetmoe.train.data import IGNORE, Row
from hetmoe.train.lora import attach_lora, save_adapter
from hetmoe.train.report import StepLog
from hetmoe.train.sft_config import SftConfig


@dataclass(frozen=True)
class SftResult:
    """What a run produced."""

    adapter: Path
    history: list[StepLog]
    resumed_from: int
    """The step the run resumed after (0: from the start)."""


class _Order:
    """Row index of micro-batch i: per-epoch permutations seeded by (seed, epoch)."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows, self.seed = num_rows, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.int64)

    def __call__(self, i: int) -> int:
        epoch = i // self.num_rows
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_rows, generator=g)
        return int(self._perm[i % self.num_rows])


def _labeled(row: Row) -> int:
    """Tokens of a row with a loss (HF shifts labels by one)."""
    return sum(label != IGNORE for label in row.labels[1:])


def train(model: Any, rows: list[Row], config: SftConfig, out: Path,
          resume: bool = False, on_step: Callable[[StepLog], None] | None = None) -> SftResult:
    """Trains a LoRA adapter on `model` (a loaded hetmoe or transformers causal LM) over the
    packed `rows`; writes the adapter to `out` (PEFT format) and checkpoints under
    `out/checkpoints`. `resume` continues from the newest checkpoint (same options and data:
    the run ends as the uninterrupted one would). `on_step` sees each step's log."""
    device = next(model.parameters()).device
    torch.manual_seed(config.seed)
    peft_model = attach_lora(model, config.lora)
    if config.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the old name warns since 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    total = config.total_steps(len(rows))
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, total)
    data = fingerprint(rows)
    history: list[StepLog] = []
    start = 0
    found = latest_checkpoint(out) if resume else None
    if resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out / 'checkpoints'}")
    if found is not None:
        state = load_checkpoint(found, peft_model, config.record(), data)
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        torch.set_rng_state(state.rng)
        start, history = state.step, state.history
    order = _Order(len(rows), config.seed)
    for step in range(start, total):
        began = time.perf_counter()
        batch = [rows[order(step * config.grad_accum + j)] for j in range(config.grad_accum)]
        items = sum(_labeled(row) for row in batch)
        loss_sum = 0.0
        for row in batch:
            if _labeled(row) == 0:
                continue
            ids, labels, positions = (torch.tensor([v], device=device) for v in
                                      (row.input_ids, row.labels, row.position_ids))
            loss = peft_model(input_ids=ids, labels=labels, position_ids=positions,
                              use_cache=False, num_items_in_batch=items).loss
            loss.backward()
            loss_sum += float(loss.detach())
        if config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log = StepLog(step + 1, loss_sum, lr, sum(len(r.input_ids) for r in batch),
                      time.perf_counter() - began)
        history.append(log)
        if on_step is not None:
            on_step(log)
        if config.save_every and log.step % config.save_every == 0 and log.step < total:
            save_checkpoint(out, peft_model, TrainerState(
                log.step, optimizer.state_dict(), scheduler.state_dict(), torch.get_rng_state(),
                history, config.record(), data))
    save_adapter(peft_model, out)
    return SftResult(out, history, start)
