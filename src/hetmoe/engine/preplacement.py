"""Expert-aware pre-placement: the experts a job's prompts route to most, resident on the GPU
before the job starts (CoX-MoE's expert-aware stratification, for `hetmoe batch`).

A sample of the job's prompts (evenly spaced over its lines) is prefilled, each prompt alone, while
every MoE layer's router calls are recorded (ops/routing_record.py) and their experts counted:
prefill only, nothing decoded or sampled, and every slot freed after. The counts [E] per MoE
layer go to `ModelRunner.place(budget, counts)`, whose planner (engine/placement/placement_plan.py)
keeps each layer's most routed experts resident; the rest stay on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hetmoe.engine.placement.placement_plan import GIB, PlacementPlan
from hetmoe.engine.requests.batch_job import JobLine
from hetmoe.engine.step import PrefillChunk, StepPlan
from hetmoe.ops.routing_record import record_routing

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM
    from hetmoe.engine.executor.runner import ModelRunner

SAMPLE_CHUNK = 2048
"""Prompt tokens per prefill step of the sample (longer prompts continue in later steps)."""


def sample_lines(lines: Sequence[JobLine], n: int) -> list[JobLine]:
    """At most `n` lines, evenly spaced over `lines` (all of them when n >= their number)."""
    if n < 0:
        raise ValueError(f"the placement sample must be >= 0 prompts, got {n}")
    if n >= len(lines):
        return list(lines)
    return [lines[i * len(lines) // n] for i in range(n)]


def line_prompt(llm: LLM, line: JobLine) -> list[int]:
    """The prompt ids of a job line as the API builds them for a plain request: chat messages
    through the chat template (text parts of a content list joined), a completion prompt (text
    or ids; of a list of prompts, the first). ValueError naming the line when it has none."""
    body = line.body
    if line.url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"line {line.number}: 'messages' must be a non-empty list")
        turns = [{"role": m.get("role"), "content": _text(m.get("content"))}
                 for m in messages if isinstance(m, dict)]
        try:
            return list(llm.chat_prompt(turns))
        except Exception as exc:  # the template's own errors (jinja's, its raise_exception)
            raise ValueError(f"line {line.number}: the chat template cannot render its "
                             f"messages: {exc}") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a list of prompts: the first
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt):
        return list(llm.encode(prompt))
    raise ValueError(f"line {line.number}: 'prompt' must be a string or token ids")


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def count_routing(runner: ModelRunner, prompts: Sequence[Sequence[int]],
                  chunk: int = SAMPLE_CHUNK) -> list[torch.Tensor]:
    """Routing counts [E] per MoE layer (on the host) of prefilling each prompt alone (cut to
    the context window; `chunk` tokens per step). Pads never run: one prompt per step."""
    if chunk < 1:
        raise ValueError(f"count_routing: chunk must be >= 1 token, got {chunk}")
    slot = runner.cache.allocate()
    try:
        with record_routing(runner.model) as routing:
            if not routing.layers:
                raise ValueError("routing counts need a model with hybrid_moe layers")
            counts = routing.counts()  # [E] zeros per MoE layer, on the router's device
            for prompt in prompts:
                ids = [int(t) for t in prompt[:runner.max_seq_len]]
                for start in range(0, len(ids), chunk):
                    part = PrefillChunk(slot, tuple(ids[start:start + chunk]), start)
                    runner.step(StepPlan(prefills=(part,)))
                    # Counted on the device step by step: no step's ids are kept.
                    for total, step in zip(counts, routing.counts(), strict=True):
                        total += step
                    routing.clear()
        return [c.cpu() for c in counts]
    finally:
        runner.free(slot)


@dataclass(frozen=True)
class Preplaced:
    """What pre-placement did: the sample and the plan it made."""

    prompts: int
    """Prompts of the sample that were prefilled."""
    tokens: int
    """Their tokens."""
    skipped: tuple[str, ...]
    """Why each sampled line without a prompt was left out (the job reports it on its own)."""
    plan: PlacementPlan
    """The placement, by the sample's routing counts."""
    counts: tuple[torch.Tensor, ...]
    """Routing counts [E] per MoE layer of the sample."""

    def describe(self) -> str:
        """One line for the job's log."""
        share = self.plan.gpu_share(self.counts)
        return (f"pre-placement: {self.prompts} sampled prompts ({self.tokens} tokens) routed; "
                f"{self.plan.bytes / GIB:.2f} GiB of experts on the GPU, the most routed per "
                f"layer: {share:.1%} of the sample's routed work"
                + (f" ({len(self.skipped)} sampled lines without a prompt)" if self.skipped
                   else ""))


def preplace(llm: LLM, lines: Sequence[JobLine], sample: int,
             budget: int | str) -> Preplaced:
    """Routes a sample of `sample` of the job's `lines` and places the most routed experts under
    `budget` (bytes or "auto", as `EngineConfig.gpu_expert_bytes`)."""
    prompts, skipped = [], []
    for line in sample_lines(lines, sample):
        try:
            prompts.append(line_prompt(llm, line))
        except ValueError as exc:
            skipped.append(str(exc))
    if not prompts:
        raise ValueError(f"pre-placement: none of the {sample} sampled lines has a prompt "
                         f"({'; '.join(skipped[:3])})")
    counts = count_routing(llm.runner, prompts)
    plan = llm.runner.place(budget, counts)
    tokens = sum(min(len(p), llm.runner.max_seq_len) for p in prompts)
    return Preplaced(len(prompts), tokens, tuple(skipped), plan, tuple(counts))
