"""Route: Anthropic's POST /v1/messages (streamed as its named SSE events) over the same scheduler,
chat template, tool parsing, validation and sampling defaults as the OpenAI routes; errors in
Anthropic's shape (`errors.ANTHROPIC_PATHS`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetmoe.engine.requests.request import Event, QueueFull
from hetmoe.server import api, tools
from hetmoe.server.anthropic_protocol import (
    MessagesRequest,
    content_blocks,
    new_message_id,
    stop_reason,
    usage,
)
from hetmoe.server.errors import APIError, anthropic_error
from hetmoe.server.notices import notice_headers
from hetmoe.server.sampling import request_sampling
from hetmoe.server.service import EventStream, ModelService
from hetmoe.server.tool_stream import CallArguments, CallStart, Delta, ToolStream

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def messages(request: Request) -> JSONResponse | StreamingResponse:
    """Anthropic Messages: system prompt, stop_sequences, temperature / top_p / top_k, tools."""
    started = time.perf_counter()
    body: MessagesRequest = await api.parse_body(request, MessagesRequest)
    service = api.check_model(request, body.model)
    plan = tools.make_plan(*body.openai_tools(), service.chat_template)
    chat = body.chat_messages()
    if chat[-1].role == "assistant":
        raise APIError(400, "field 'messages': the last message must be the user's "
                       "(continuing an assistant turn is not served)", "messages")
    prompt_ids = tools.render_chat(service, chat, plan)
    max_tokens = api.check_window(service, len(prompt_ids), body.max_tokens, "messages",
                                  "max_tokens")
    fmt = await api.compiled(service, plan.forced(), "tools") if plan is not None else None
    params = request_sampling(service.llm.sampling_defaults, max_tokens,
                              temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              stop=body.stop_sequences or (),
                              adapter=service.adapter_of(body.model), response_format=fmt)
    try:
        stream = service.submit([prompt_ids], params)
    except QueueFull as exc:
        raise APIError(429, f"server busy: {exc}; retry later") from None
    except RuntimeError as exc:
        raise APIError(503, f"server unavailable: {exc}") from None
    metrics = request.app.state.metrics
    metrics.prompt(len(prompt_ids))
    observe = api.observer(metrics, started)
    headers = notice_headers(request.url.path, body, plan)
    if body.stream:
        return _sse(_events(new_message_id(), body, stream, observe, plan, service), stream,
                    headers)
    choice = (await api.collect(request, stream, observe, 1)).all[0]
    assert choice.last is not None
    text = "".join(choice.text)
    parsed = plan.parse(text) if plan is not None and text else None
    if plan is not None and parsed is None and plan.choice != "auto":
        raise plan.missing_call(text)
    ids = plan.ids(len(parsed.calls)) if plan is not None and parsed is not None else []
    stop = None if parsed else _matched_stop(service, choice.token_ids, body.stop_sequences)
    return JSONResponse({
        "id": new_message_id(), "type": "message", "role": "assistant", "model": body.model,
        "content": content_blocks(text, parsed, ids),
        "stop_reason": stop_reason(choice.finish_reason, stop, parsed is not None),
        "stop_sequence": stop,
        "usage": usage(choice.last.prompt_tokens, choice.last.completion_tokens,
                       choice.last.cached_tokens),
    }, headers=headers)


def _matched_stop(service: ModelService, token_ids: Sequence[int],
                  stops: Sequence[str] | None) -> str | None:
    """The stop sequence that ended the answer: the first one in its tokens' text (generation
    stops at the first), None when it ended otherwise."""
    if not stops:
        return None
    full = service.text(token_ids)
    found = [(full.find(s), s) for s in stops if s in full]
    return min(found)[1] if found else None


class _Blocks:
    """A streamed message's content blocks: text and tool uses in order, one open at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # the kind of the open block

    def add(self, piece: Delta) -> list[tuple[str, dict[str, Any]]]:
        """The events of a content delta or a piece of a call."""
        events = []
        if isinstance(piece, CallStart) or (isinstance(piece, str) and self.open != "text"):
            events += self.close()
            block: dict[str, Any] = ({"type": "text", "text": ""} if isinstance(piece, str) else
                                     {"type": "tool_use", "id": piece.id, "name": piece.name,
                                      "input": {}})
            events.append(_block_start(self.count, block))
            self.open = block["type"]
            self.count += 1
        if isinstance(piece, str) and piece:
            events.append(_delta(self.count - 1, {"type": "text_delta", "text": piece}))
        elif isinstance(piece, CallArguments):
            events.append(_delta(self.count - 1, {"type": "input_json_delta",
                                                  "partial_json": piece.text}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The open block's stop event, if one is open."""
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]


async def _events(mid: str, body: MessagesRequest, stream: EventStream,
                  observe: Callable[[Event], None], plan: tools.ToolPlan | None,
                  service: ModelService) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """message_start, the content blocks (text deltas; each tool use's input as it is
    generated), message_delta (stop reason, output tokens), message_stop; `error` if
    generation fails."""
    calls = ToolStream(plan) if plan is not None else None
    blocks = _Blocks()
    last: Event | None = None
    token_ids: list[int] = []
    async for event in stream:
        observe(event)
        if event.finish_reason in ("error", "cancelled"):
            failed = event.finish_reason == "error"
            yield "error", anthropic_error(500 if failed else 503, f"generation failed: "
                                           f"{event.error}" if failed else "server shutting down")
            return
        if last is None:
            message: dict[str, Any] = {
                "id": mid, "type": "message", "role": "assistant", "model": body.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(event.prompt_tokens, 0, event.cached_tokens)}
            yield "message_start", {"type": "message_start", "message": message}
        last = event
        token_ids.extend(event.token_ids)
        pieces = calls.feed(event.text) if calls is not None else [event.text]
        for piece in pieces:
            if piece:
                for item in blocks.add(piece):
                    yield item
    assert last is not None and last.finish_reason is not None
    rest, parsed = calls.finish() if calls is not None else ([], None)
    if plan is not None and parsed is None and plan.choice != "auto":
        yield "error", anthropic_error(422, plan.missing_call(calls.text if calls else "").message)
        return
    if not blocks.count and not rest:
        rest = [""]  # an empty answer still has its text block
    for piece in rest:
        for item in blocks.add(piece):
            yield item
    for item in blocks.close():
        yield item
    stop = None if parsed else _matched_stop(service, token_ids, body.stop_sequences)
    reason = stop_reason(last.finish_reason, stop, parsed is not None)
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence": stop},
                            "usage": {"output_tokens": last.completion_tokens}}
    yield "message_stop", {"type": "message_stop"}


def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {"type": "content_block_start", "index": index,
                                   "content_block": block}


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _sse(events: AsyncIterator[tuple[str, dict[str, Any]]], stream: EventStream,
         notices: dict[str, str]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for name, data in events:
                yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
        finally:
            stream.cancel()  # the client disconnected (or the stream ended): free the slot

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **notices}
    return StreamingResponse(lines(), media_type="text/event-stream", headers=headers)
