"""Log-probabilities of chosen tokens and their most likely alternatives, from a step's logits.

Computed where the logits are (the GPU in a GPU run): one log_softmax over the rows that asked,
a gather of each row's token and one top-k, then a single copy of those few numbers to the host.
They are the model's own distribution (raw logits), before any penalty or temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability at one position, and that position's most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the most likely tokens at this position, most likely
    first (as many as asked for)."""
    token: str | None = None
    """The token's text (set in `LLM.generate`'s outputs; special tokens spelled out)."""
    top_tokens: tuple[tuple[str, float], ...] | None = None
    """`top` with each token's text in place of its id (set in `LLM.generate`'s outputs)."""


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   tops: Sequence[int]) -> list[TokenLogprob]:
    """logits [R, V] (any device), tokens[r] chosen at row r, tops[r] alternatives wanted for
    row r -> one `TokenLogprob` per row."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens) or len(tokens) != len(tops):
        raise ValueError(f"logits {tuple(logits.shape)} need one token and one top count per "
                         f"row, got {len(tokens)} tokens and {len(tops)} counts")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    index = torch.tensor(list(tokens), dtype=torch.long).to(logp.device)[:, None]  # [R, 1]
    chosen = logp.gather(1, index)  # [R, 1]
    k = min(max(tops, default=0), logp.shape[1])
    if k > 0:
        values, ids = logp.topk(k, dim=-1)  # [R, k] each, most likely first
        host = torch.cat([chosen, values, ids.to(values.dtype)], dim=1).cpu()  # [R, 1 + 2k]
    else:
        host = chosen.cpu()
    rows = host.tolist()
    out = []
    for row, token, top in zip(rows, tokens, tops, strict=True):
        count = min(top, k)
        alternatives = tuple((int(row[1 + k + j]), row[1 + j]) for j in range(count))
        out.append(TokenLogprob(int(token), row[0], alternatives))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int],
                    top: int) -> list[TokenLogprob | None]:
    """The prompt's tokens scored by the prefill's logits [T, V] of every position: token i by
    position i - 1; the first token has no score (None)."""
    if logits.shape[0] != len(prompt_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for a prompt of "
                         f"{len(prompt_ids)} tokens")
    scored = token_logprobs(logits[:-1], prompt_ids[1:], [top] * (len(prompt_ids) - 1))
    return [None, *scored]
