"""The server's model: an `LLM`, its tokenizer and the scheduler that batches its requests."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from hetmoe.engine.requests.request import Event
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.engine.requests.scheduler import RequestHandle, Scheduler
from hetmoe.server.logprobs import TokenText
from hetmoe.server.tool_generic import template_format
from hetmoe.server.tool_parsers import ToolFormat, detect
from hetmoe.server.tools import template_text

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM

log = logging.getLogger("hetmoe.server")


class EventStream:
    """The events of one API request's `choices` choices (its prompts x n), delivered from the
    scheduler thread into the event loop, each with its choice index."""

    def __init__(self, choices: int = 1) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.handles: list[RequestHandle] = []
        self._left = choices
        self.finished = False
        """True once every choice has ended."""

    def sink(self, event: Event, base: int = 0) -> None:
        """Called on the scheduler thread; `base` + the event's index is the choice index."""
        if base:
            event = dataclasses.replace(event, index=base + event.index)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self, timeout: float | None = None) -> Event:
        """The next event (asyncio.TimeoutError after `timeout` seconds)."""
        event = await asyncio.wait_for(self._queue.get(), timeout)
        if event.finish_reason is not None:
            self._left -= 1
            self.finished = self._left <= 0
        return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()

    def cancel(self) -> None:
        """Frees the requests' slots unless they already finished."""
        if not self.finished:
            for handle in self.handles:
                handle.cancel()


class ModelService:
    """Holds the model and its scheduler; turns prompts into token ids and requests into streams."""

    def __init__(self, llm: LLM, name: str, max_queue: int) -> None:
        self.llm = llm
        self.name = name
        self.created = int(time.time())
        self.tokenizer = llm.tokenizer
        self.runner = llm.runner
        self.chat_template: str | None = template_text(llm.tokenizer)
        """The tokenizer's chat template text (tools are parsed by the format it writes)."""
        self.tool_format: ToolFormat | None = detect(self.chat_template or "")
        form, prompted = template_format(self.chat_template)
        if self.chat_template and prompted and form is not None:
            log.warning("the chat template of %s renders no tools: requests with tools get them "
                        "in the system message, calls in the %s format (header "
                        "x-hetmoe-tool-format: %s)", name, form.name, form.name)
        self._kept_ids = self._marker_ids(self.tool_format)
        # The tokenizer is used from the event loop (encode) and the scheduler thread (decode).
        self._tokenizer_lock = threading.Lock()
        self.token_text = TokenText(llm.tokenizer, llm.decode, self._tokenizer_lock)
        """Token id -> (text, bytes), for log-probabilities."""
        # The LLM's one loop, now on a thread: `llm.generate` shares its batches.
        self.scheduler: Scheduler = llm.start_loop(max_queue, self._decode)

    @property
    def adapters(self) -> tuple[str, ...]:
        """LoRA adapters a request may name as its `model` (`hetmoe serve --lora NAME=PATH`)."""
        loaded = self.runner.adapters
        return tuple(loaded.names) if loaded is not None else ()

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request naming `model` runs (None: the base model, `name`)."""
        return model if model != self.name and model in self.adapters else None

    @property
    def context_len(self) -> int:
        """Prompt + generated tokens per sequence at most."""
        return int(self.runner.max_seq_len)

    @property
    def slots(self) -> int:
        """KV-cache slots: sequences decoded together at most."""
        return int(self.runner.max_batch)

    def chat_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of `messages` [(role, text)] through the model's chat template."""
        return self.render([{"role": r, "content": t} for r, t in messages])

    def render(self, turns: Sequence[dict[str, Any]],
               tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of chat turns (and tools) through the model's chat template."""
        with self._tokenizer_lock:
            return list(self.llm.chat_prompt(turns, tools))

    def text_ids(self, prompt: str, special_tokens: bool = True) -> list[int]:
        """Token ids of a raw completion prompt (with the tokenizer's usual special tokens, or
        without them)."""
        with self._tokenizer_lock:
            if special_tokens or self.tokenizer is None:
                return list(self.llm.encode(prompt))
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               ignore_eos: bool = False, n: int = 1) -> EventStream:
        """Queues `n` choices of each prompt (choice index = prompt index x n + i); if one
        cannot be queued, those queued before it are cancelled (QueueFull, ValueError and
        RuntimeError pass through)."""
        stream = EventStream(len(prompts) * n)
        try:
            for p, ids in enumerate(prompts):
                sink = functools.partial(stream.sink, base=p * n)
                stream.handles.append(self.scheduler.submit(ids, params, sink, ignore_eos, n=n))
        except BaseException:
            stream.cancel()
            raise
        return stream

    def text(self, token_ids: Sequence[int]) -> str:
        """Text of token ids (an echoed prompt given as ids)."""
        return self._decode(list(token_ids))

    def close(self) -> None:
        """Stops the scheduler thread (requests in flight end as cancelled)."""
        self.llm.stop_loop()

    def _marker_ids(self, form: ToolFormat | None) -> dict[int, str]:
        """Special tokens that spell the tool-call syntax: decoding keeps them."""
        tokenizer = self.tokenizer
        if form is None or tokenizer is None:
            return {}
        special = set(tokenizer.all_special_ids)
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(token, "special", False):
                special.add(tokenizer.convert_tokens_to_ids(token.content))
        ids = {tokenizer.convert_tokens_to_ids(m): m for m in form.markers}
        return {i: m for i, m in ids.items() if isinstance(i, int) and i in special}

    def _decode(self, token_ids: list[int]) -> str:
        with self._tokenizer_lock:
            if not self._kept_ids or not any(t in self._kept_ids for t in token_ids):
                return self.llm.decode(token_ids)
            parts, run = [], list[int]()
            for token in token_ids:
                if token in self._kept_ids:
                    parts += [self.llm.decode(run), self._kept_ids[token]]
                    run = []
                else:
                    run.append(token)
            return "".join([*parts, self.llm.decode(run)])
