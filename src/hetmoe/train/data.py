"""SFT data: a local JSONL file of chat `messages` or `prompt`/`completion` pairs, checked line by
line (errors name the file and line, before any model loads), read with `datasets`, rendered by
the tokenizer's chat template with labels on the assistant's tokens only, and packed.

Packing: samples are laid end to end into rows of at most `seq_len` tokens, each sample's
positions starting at 0. With no attention mask, transformers builds a block-diagonal causal mask
from such position ids (`masking_utils.find_packed_sequence_indices`), so no token attends across
samples; the first token of each sample is unlabeled, so no loss crosses a boundary either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import load_dataset

IGNORE = -100
"""Label of tokens without loss (transformers' ignore index)."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sample:
    """One tokenized example."""

    input_ids: list[int]
    labels: list[int]
    """input_ids on the assistant's tokens, IGNORE elsewhere."""


@dataclass(frozen=True)
class Row:
    """One packed training row: samples end to end, positions restarting at each."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]


def _check_line(path: Path, number: int, record: Any) -> str:
    """The record's format (`messages` or `prompt`); ValueError naming file and line."""
    where = f"{path}:{number}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: `messages` must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: messages[{i}] must be {{role: one of {ROLES}, "
                                 f"content: string}}, got {json.dumps(m)[:80]}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message (nothing to learn)")
        return "messages"
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return "prompt"
    raise ValueError(f"{where}: expected `messages` (a list of {{role, content}}) or `prompt` "
                     f"and `completion` strings; found keys {sorted(record)}")


def check_file(path: str | Path) -> int:
    """Checks a JSONL file of SFT examples before any model loads; returns the example count.
    Blank lines are skipped; one format (messages or prompt/completion) per file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    first: tuple[str, int] | None = None
    count = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg}, column "
                                 f"{exc.colno})") from None
            kind = _check_line(path, number, record)
            if first is None:
                first = (kind, number)
            elif kind != first[0]:
                raise ValueError(f"{path}:{number}: a `{kind}` example after `{first[0]}` ones "
                                 f"(line {first[1]}); use one format per file")
            count += 1
    if count == 0:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return count


def read_examples(path: str | Path) -> list[dict[str, Any]]:
    """The checked file's examples as chat messages (prompt/completion: one user and one
    assistant turn), read with `datasets`."""
    check_file(path)
    data = load_dataset("json", data_files=str(path), split="train")
    if "messages" in data.column_names:
        return [{"messages": [{"role": m["role"], "content": m["content"]} for m in row]}
                for row in data["messages"]]
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
            for p, c in zip(data["prompt"], data["completion"], strict=True)]


def tokenize(tokenizer: Any, messages: list[dict[str, str]]) -> Sample:
    """Renders `messages` with the chat template; labels are the assistant turns' tokens (the
    reply and the template's end-of-turn after it), as the generation prompt opens them.

    Each assistant turn's text is the template of the turns through it minus the template of
    the turns before it with the generation prompt; tokens are assigned to turns by their
    character offsets in the whole rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; SFT renders every example with it")

    def render(turns: list[dict[str, str]], open_reply: bool) -> str:
        text: str = tokenizer.apply_chat_template(turns, tokenize=False,
                                                  add_generation_prompt=open_reply)
        return text

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], True)), len(render(messages[:i + 1], False))
        if not full.startswith(render(messages[:i + 1], False)) or start > end:
            raise ValueError("the chat template does not render a conversation as the prefix "
                             "of its continuation; assistant tokens cannot be located")
        spans.append((start, end))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [t if any(s <= a < e for s, e in spans) else IGNORE
              for t, (a, _) in zip(ids, encoded["offset_mapping"], strict=True)]
    return Sample(ids, labels)


def pack(samples: list[Sample], seq_len: int) -> tuple[list[Row], int]:
    """Samples laid end to end, in order, into rows of at most `seq_len` tokens (a sample that
    does not fit the current row starts the next); a sample longer than seq_len is cut to it.
    Returns the rows and how many samples were cut."""
    rows: list[Row] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    cut = 0
    for sample in samples:
        n = len(sample.input_ids)
        if n > seq_len:
            cut += 1
            n = seq_len
        if ids and len(ids) + n > seq_len:
            rows.append(Row(ids, labels, positions))
            ids, labels, positions = [], [], []
        ids += sample.input_ids[:n]
        labels += [IGNORE] + sample.labels[1:n]  # no loss predicts a sample from the one before
        positions += list(range(n))
    if ids:
        rows.append(Row(ids, labels, positions))
    return rows, cut


def build_rows(path: str | Path, tokenizer: Any, seq_len: int) -> tuple[list[Row], int]:
    """The packed rows of a data file and how many of its samples were cut to `seq_len`;
    ValueError when no row has a labeled token (e.g. every reply cut away)."""
    samples = [tokenize(tokenizer, e["messages"]) for e in read_examples(path)]
    rows, cut = pack(samples, seq_len)
    if not any(label != IGNORE for row in rows for label in row.labels):
        raise ValueError(f"{path}: no assistant token within --seq-len {seq_len} tokens")
    return rows, cut
