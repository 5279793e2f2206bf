"""`hetmoe batch`'s KV cache sized from its job, before the weights load.

Each line still to run is tokenized as the API's routes will tokenize it: the body validated by
the route's own model, a chat's tool plan and messages through the chat template
(server/tools.py `render_chat`), a completion's prompts as text or ids. A line needs its longest
prompt plus its token budget (`max_completion_tokens` / `max_tokens`; none: the rest of the
window, as the routes give, in the window `hetmoe serve` and `LLM` default to, the model's
context capped at 4096, or its prompt + 1 if longer; `max_tokens: 0` with echo: 1) and
holds one KV slot per sequence (prompts x n). A line the routes refuse (a body that does not
validate, another model, messages the template cannot render) needs nothing: its error comes
from the route.

`--max-seq-len auto`: the longest need, rounded up to a multiple of `WINDOW_STEP`, capped at
the model's context. `--max-batch auto`: min(the job's sequences, the slots whose KV fits,
`MAX_AUTO_SLOTS`) (engine/model/kv_fit.py). A line longer than the window is answered with its
own 400 before the job starts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetmoe.cli_engine import EngineOptions
from hetmoe.engine.model.chat_template import chat_ids, read_chat_template, set_chat_template
from hetmoe.engine.model.kv_fit import KvFit, fit_slots, kv_room, planned_memory
from hetmoe.engine.model.model_setup import check_device, read_config, resolve_dtype
from hetmoe.engine.model.model_source import DEFAULT_MAX_SEQ_LEN, open_model
from hetmoe.engine.requests.batch_job import JobLine
from hetmoe.loading.load import load_tokenizer
from hetmoe.loading.memory_plan import kv_bytes_per_token
from hetmoe.server import protocol, tools
from hetmoe.server.errors import APIError

WINDOW_STEP = 256
"""`auto` windows are multiples of this (the decode step's smallest window bucket)."""


class JobTokens:
    """The API's tokenization (`tools.ChatRenderer`) with a tokenizer alone (`ModelService`
    renders through `LLM.chat_prompt` and `LLM.encode`: the same calls)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template = tools.template_text(tokenizer)

    def render(self, turns: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of chat turns (and tools) through the chat template."""
        if self.tokenizer is None or not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        return chat_ids(self.tokenizer, turns, tools)

    def text_ids(self, prompt: str, special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's usual special tokens)."""
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer: pass token ids, not text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=special_tokens))


@dataclass(frozen=True)
class LineNeed:
    """What one line asks of the KV cache."""

    line: JobLine
    prompt: int
    """Tokens of its longest prompt."""
    budget: int | None
    """Tokens it may generate (None: the rest of the window)."""
    budget_field: str
    """The body field the budget comes from (named in its error)."""
    prompt_field: str
    sequences: int
    """KV slots it holds: prompts x n."""

    def tokens(self, context: int) -> int:
        """Window it needs; when it generates to the window's end, the engine's default window
        (`context` capped at DEFAULT_MAX_SEQ_LEN), or its prompt + 1 if longer: a whole long
        context for each such line would leave a job few slots."""
        if self.budget:
            return self.prompt + self.budget
        return min(context, max(DEFAULT_MAX_SEQ_LEN, self.prompt + 1))

    def refusal(self, window: int, why: str) -> tuple[str, str] | None:
        """(field, message) of the 400 a window of `window` tokens gives it, as the route
        words it (None: it fits)."""
        if self.prompt >= window:
            return self.prompt_field, (
                f"field '{self.prompt_field}': the prompt has {self.prompt} tokens, the batch's "
                f"window is {window} tokens ({why}; at least one must be left to generate)")
        if self.budget and self.prompt + self.budget > window:
            return self.budget_field, (
                f"field '{self.budget_field}': prompt ({self.prompt} tokens) + "
                f"{self.budget_field} ({self.budget}) = {self.prompt + self.budget} tokens "
                f"exceed the batch's window of {window} tokens ({why})")
        return None


def line_need(line: JobLine, model: str, job: JobTokens) -> LineNeed | None:
    """The line's need as its route will tokenize it (None: the route refuses it)."""
    text = json.dumps({"model": model, **line.body})
    try:
        if line.url == "/v1/chat/completions":
            chat = protocol.ChatCompletionRequest.model_validate_json(text)
            if chat.model != model:
                return None  # the route's 404: another model
            ids = tools.render_chat(job, chat.messages, tools.plan_tools(chat, job.chat_template))
            field = "max_completion_tokens" if chat.max_completion_tokens else "max_tokens"
            return LineNeed(line, len(ids), chat.token_budget, field, "messages", chat.n)
        body = protocol.CompletionRequest.model_validate_json(text)
        if body.model != model:
            return None
        prompts = [len(job.text_ids(p)) if isinstance(p, str) else len(p) for p in body.prompts]
    except (ValueError, APIError):  # pydantic's ValidationError is a ValueError
        return None
    if body.max_tokens == 0 and not body.echo:
        return None  # the route's 400: 0 generates nothing without echo
    budget = 1 if body.max_tokens == 0 else body.max_tokens
    return LineNeed(line, max(prompts), budget, "max_tokens", "prompt", len(prompts) * body.n)


@dataclass(frozen=True)
class JobSizing:
    """The KV cache of a job and the lines it cannot hold."""

    fit: KvFit
    window_why: str
    """Where the window comes from."""
    too_long: tuple[tuple[JobLine, str, str], ...]
    """Lines longer than the window, with the field and message of the 400 each gets."""

    def describe(self) -> str:
        """The one line printed before the weights load."""
        return f"batch KV cache: {self.fit.describe()}; window: {self.window_why}"


def window_of(needs: Sequence[LineNeed], context: int,
              asked: int | None) -> tuple[int, str, str]:
    """(window, where it comes from, the reason a too-long line's error names): `asked`, or
    the longest need of the lines the model's `context` holds, rounded up to a multiple of
    `WINDOW_STEP`, capped at `context` (a longer line gets its error at any window)."""
    if asked is not None:
        return asked, f"--max-seq-len {asked}", f"--max-seq-len {asked}"
    held = [n for n in needs if n.refusal(context, "") is None]
    longest = max((n.tokens(context) for n in held), default=1)
    rounded = -(-longest // WINDOW_STEP) * WINDOW_STEP
    open_ended = sum(1 for n in held if not n.budget)
    if open_ended:
        default = min(context, DEFAULT_MAX_SEQ_LEN)
        why = (f"{open_ended} of the lines set no max_tokens (each generates to the window's "
               f"end): the longest need, {longest} tokens, rounded up to {min(rounded, context)}"
               f" (such a line needs the default window, {default} tokens, or its prompt + 1)")
    else:
        why = (f"the longest line's prompt + max_tokens, {longest} tokens, rounded up to "
               f"{rounded}")
        if rounded > context:
            why += f", capped at the model's context, {context} tokens"
    return min(rounded, context), why, f"the model's context, {context} tokens"


def too_long(needs: Sequence[LineNeed], window: int,
             why: str) -> list[tuple[JobLine, str, str]]:
    """The lines a window of `window` tokens cannot hold, each with its 400's field and
    message."""
    return [(n.line, *refusal) for n in needs if (refusal := n.refusal(window, why))]


def size_job(model: str, todo: Sequence[JobLine], engine: EngineOptions, slots: int | None,
             window: int | None, progress: bool) -> JobSizing:
    """The KV cache of the job `todo` on `model` as `engine` will load it (`slots` / `window`:
    the explicit numbers, None for auto); ValueError before any weight is read when not even
    one slot fits, or the model cannot be opened."""
    device = check_device(engine.device)
    path, converted = open_model(model, False, progress, engine.experts)
    dtype = resolve_dtype(engine.dtype, read_config(path))
    tokenizer = load_tokenizer(path)
    if engine.chat_template is not None:
        set_chat_template(tokenizer, read_chat_template(engine.chat_template),
                          str(engine.chat_template), path)
    mem, config = planned_memory(path, device, dtype, engine.rules, engine.experts, converted)
    job = JobTokens(tokenizer)
    needs = [need for line in todo if (need := line_need(line, model, job)) is not None]
    context = int(getattr(config, "max_position_embeddings", DEFAULT_MAX_SEQ_LEN))
    chosen, why, reason = window_of(needs, context, window)
    refused = too_long(needs, chosen, reason)
    held = {line.number for line, _, _ in refused}
    wanted = sum(n.sequences for n in needs if n.line.number not in held)
    room = kv_room(mem, device, engine.expert_bytes())
    fit = fit_slots(room, kv_bytes_per_token(config, dtype), chosen, wanted, slots)
    return JobSizing(fit, why, tuple(refused))
