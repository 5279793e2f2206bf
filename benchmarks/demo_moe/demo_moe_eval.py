"""What the demo-moe scripts of this folder measure alike, written once: the held-out windows and
their perplexity, the question set and its greedy exact match, the routers' picks over windows,
and the report's stamp line and marked tables.

The scripts import it as a sibling (Python puts a script's folder first on sys.path).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from hetmoe import LLM
from hetmoe.engine.executor.runner import ModelRunner
from hetmoe.machine import cpu_model, source_commit
from hetmoe.ops.routing_record import record_routing
from hetmoe.presets.demo_moe_corpus import held_out_texts, token_windows

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the commit of the stamp line, and the scripts' paths in commands."""

QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of the United Kingdom?", ("london",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is 2 + 2?", ("4", "four")),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the opposite of hot?", ("cold",)),
    ("What language is spoken in Brazil?", ("portuguese",)),
    ("Who painted the Mona Lisa?", ("leonardo", "vinci")),
    ("What is the currency of Japan?", ("yen",)),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("What do bees make?", ("honey",)),
    ("What is the boiling point of water in degrees Celsius?", ("100",)),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What animal is known as the king of the jungle?", ("lion",)),
]
"""(question, accepted answers): right when the reply contains one of them (case-folded)."""


def answered_right(questions: Sequence[int], replies: Sequence[str]) -> list[int]:
    """The `questions` (indices into QUESTIONS) whose reply holds an accepted answer."""
    if len(questions) != len(replies):
        raise ValueError(f"{len(questions)} questions but {len(replies)} replies")
    return [q for q, reply in zip(questions, replies, strict=True)
            if any(a in reply.lower() for a in QUESTIONS[q][1])]


def exact_match(questions: Sequence[int], replies: Sequence[str]) -> float:
    """Share of `questions` answered right (0 for none asked)."""
    return len(answered_right(questions, replies)) / max(len(questions), 1)


def held_out_windows(encode: Callable[[str], list[int]], length: int,
                     count: int) -> list[list[int]]:
    """The held-out documentation topics (never read by the build) as `count` windows of
    `length` tokens: the perplexity every script of this folder reports is over these."""
    return token_windows([encode(t) for t in held_out_texts()], length, count)


@torch.no_grad()  # not inference mode: distill.py trains the model between evaluations
def perplexity(logits_of: Callable[[list[int]], torch.Tensor], windows: Sequence[list[int]],
               on_window: Callable[[int, torch.Tensor], None] | None = None) -> float:
    """exp(mean NLL) of every next token of `windows`; `logits_of(ids)` gives [T, V] per window.
    `on_window(w, log_probs [T, V])` sees each window's log-probs (a KL against them, say)."""
    if not windows:
        raise ValueError("perplexity needs at least one window; got none")
    nll, count = 0.0, 0
    for w, ids in enumerate(windows):
        if len(ids) < 2:
            raise ValueError(f"window {w} has {len(ids)} token(s); perplexity needs at least 2")
        logp = logits_of(ids).float().log_softmax(-1)  # [T, V]
        nll += F.nll_loss(logp[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
        if on_window is not None:
            on_window(w, logp)
    return math.exp(nll / count)


def prefill_with(runner: ModelRunner, windows: Sequence[list[int]],
                 hooks: Sequence[torch.utils.hooks.RemovableHandle]) -> None:
    """Prefills each window alone in slot 0 while `hooks` record, then removes them."""
    try:
        for ids in windows:
            runner.lengths[0] = 0
            runner.prefill(0, ids)
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def record_picks(llm: LLM, runner: ModelRunner,
                 windows: Sequence[list[int]]) -> list[torch.Tensor]:
    """Expert ids [N, K] each MoE layer's router picks over the windows (prefill, exact)."""
    with record_routing(llm.model) as routing:
        prefill_with(runner, windows, [])
    return routing.picks()


def stamp(script: str, argv: Sequence[str] | None) -> dict[str, str]:
    """What a report's figures come from: the command (`script` run with `argv`, or this
    process's arguments), the UTC date, the machine and the commit."""
    args = list(argv) if argv is not None else sys.argv[1:]
    path = Path(script).resolve()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return {"command": " ".join(["python", str(name), *args]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": f"{cpu_model()}, {torch.get_num_threads()} torch threads",
            "git": source_commit(ROOT)}


def stamp_line(facts: dict[str, str], details: str) -> str:
    """The line above a report's table: its command, date, machine, commit and `details`."""
    return (f"`{facts['command']}` ({facts['date']}, {facts['machine']}, git {facts['git']}; "
            f"{details})")


def markers(what: str, script: str) -> tuple[str, str]:
    """The comments that open and close the part of a report `script` writes for `what`."""
    return f"<!-- {what}: written by {script} -->", f"<!-- /{what} -->"


def write_marked(doc: Path, what: str, script: str, body: str) -> None:
    """Replaces the text between the doc's `what` markers of `script` (benchmarks/demo_moe/...)
    by `body`; the prose around them is kept, and each script owns its pairs."""
    begin, end = markers(what, script)
    text = doc.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{doc} lacks the {what} markers {begin!r} ... {end!r}")
    head, rest = text.split(begin, 1)
    doc.write_text(f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}")
