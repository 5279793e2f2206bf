"""The server's model: an `LLM`, its tokenizer and the scheduler that batches its requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from hetmoe.engine.sampler import SamplingParams
from hetmoe.engine.scheduler import Event, RequestHandle, Scheduler

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM


class EventStream:
    """One request's events, delivered from the scheduler thread into the event loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.handle: RequestHandle | None = None
        self.finished = False

    def sink(self, event: Event) -> None:
        """Called on the scheduler thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self, timeout: float | None = None) -> Event:
        """The next event (asyncio.TimeoutError after `timeout` seconds)."""
        event = await asyncio.wait_for(self._queue.get(), timeout)
        self.finished = event.finish_reason is not None
        return event

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.finished:
            yield await self.next()

    def cancel(self) -> None:
        """Frees the request's slot unless it already finished."""
        if self.handle is not None and not self.finished:
            self.handle.cancel()


class ModelService:
    """Holds the model and its scheduler; turns prompts into token ids and requests into streams."""

    def __init__(self, llm: LLM, name: str, max_queue: int) -> None:
        self.llm = llm
        self.name = name
        self.created = int(time.time())
        self.tokenizer = llm.tokenizer
        self.runner = llm.runner
        # The tokenizer is used from the event loop (encode) and the scheduler thread (decode).
        self._tokenizer_lock = threading.Lock()
        # The LLM's one loop, now on a thread: `llm.generate` shares its batches.
        self.scheduler: Scheduler = llm.start_loop(max_queue, self._decode)

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
        turns = [{"role": r, "content": t} for r, t in messages]
        with self._tokenizer_lock:
            return list(self.llm.chat_prompt(turns))

    def text_ids(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt (with the tokenizer's usual special tokens)."""
        with self._tokenizer_lock:
            return list(self.llm.encode(prompt))

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, ignore_eos: bool = False
    ) -> EventStream:
        """Queues a request (QueueFull, ValueError and RuntimeError pass through)."""
        stream = EventStream()
        stream.handle = self.scheduler.submit(prompt_ids, params, stream.sink, ignore_eos)
        return stream

    def close(self) -> None:
        """Stops the scheduler thread (requests in flight end as cancelled)."""
        self.llm.stop_loop()

    def _decode(self, token_ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.llm.decode(token_ids)
