"""Routes: /v1/models, /v1/chat/completions, /v1/completions, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from hetmoe.engine.request import Event, QueueFull
from hetmoe.engine.sampler import SamplingParams
from hetmoe.server import protocol, responses, tools
from hetmoe.server.errors import APIError, from_validation
from hetmoe.server.metrics import Metrics
from hetmoe.server.service import EventStream, ModelService

router = APIRouter()
# How often a non-streaming request checks whether its client is still there, seconds.
DISCONNECT_POLL_S = 0.05
GREEDY_BELOW = 1e-4
Body = protocol.ChatCompletionRequest | protocol.CompletionRequest


def _service(request: Request) -> ModelService:
    return request.app.state.service


def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the scheduler runs, 503 once it has stopped."""
    alive = _service(request).scheduler.alive
    return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text: queue depth, running requests, tokens/s, TTFT, requests by status."""
    service = _service(request)
    scheduler = service.scheduler
    text = _metrics(request).render(
        scheduler.num_waiting,
        scheduler.num_running,
        service.slots,
        scheduler.decode_steps,
        scheduler.decode_rows,
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    """The one model this server serves."""
    service = _service(request)
    return {"object": "list", "data": [protocol.model_card(service.name, service.created)]}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions, streamed as SSE when `stream` is true."""
    started = time.perf_counter()
    body = await _parse(request, protocol.ChatCompletionRequest)
    service = _check_model(request, body.model)
    plan = tools.plan_tools(body, service.chat_template)
    prompt_ids = _chat_prompt(service, body, plan)
    budget = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    stream = _submit(request, body, [prompt_ids], "messages", budget)
    rid = protocol.new_id("chatcmpl")
    observe = _observer(_metrics(request), started)
    if body.stream:
        return _sse(responses.chat_chunks(rid, body, stream, observe, service.token_text,
                                          body.n, plan), stream)
    choices = await _collect(request, stream, observe, body.n)
    return JSONResponse(responses.chat_body(rid, service.name, choices, bool(body.logprobs),
                                            service.token_text, plan))


def _chat_prompt(service: ModelService, body: protocol.ChatCompletionRequest,
                 plan: tools.ToolPlan | None) -> list[int]:
    """The messages (and the plan's tools) through the chat template; earlier calls' arguments
    go as objects, or as JSON text to a template that cannot take objects."""
    rendered = plan.tools if plan is not None else None
    calls = any(m.tool_calls for m in body.messages)
    try:
        try:
            return service.render(tools.template_messages(body.messages), rendered)
        except Exception:
            if not calls:
                raise
            return service.render(tools.template_messages(body.messages, True), rendered)
    except Exception as exc:  # a template may reject a role order; that is the client's input
        message = f"field 'messages': the chat template cannot render them: {exc}"
        raise APIError(400, message, "messages") from None


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI text completions of one prompt or several (text or token ids)."""
    started = time.perf_counter()
    body = await _parse(request, protocol.CompletionRequest)
    service = _check_model(request, body.model)
    vocab = service.runner.vocab_size
    prompts: list[list[int]] = []
    for index, prompt in enumerate(body.prompts):
        if isinstance(prompt, str):
            prompts.append(service.text_ids(prompt))
        elif any(not 0 <= t < vocab for t in prompt):
            where = "prompt" if isinstance(body.prompt[0], int) else f"prompt[{index}]"
            raise APIError(400, f"field '{where}': token ids must be in [0, {vocab})", where)
        else:
            prompts.append(list(prompt))
    stream = _submit(request, body, prompts, "prompt", "max_tokens")
    echo = None
    if body.echo:
        echo = [(p if isinstance(p, str) else service.text(ids), ids)
                for p, ids in zip(body.prompts, prompts, strict=True)]
    rid = protocol.new_id("cmpl")
    observe = _observer(_metrics(request), started)
    count = len(prompts) * body.n
    if body.stream:
        return _sse(responses.completion_chunks(rid, body, stream, observe, service.token_text,
                                                count, echo), stream)
    choices = await _collect(request, stream, observe, body.n, count)
    return JSONResponse(responses.completion_body(rid, service.name, choices,
                                                  body.logprobs is not None, echo,
                                                  service.token_text))


async def _parse(request: Request, model: type[protocol._Sampling]) -> Any:
    # JSON only: a browser page of another site cannot send it without a CORS preflight, which
    # this server never grants, so no web page can make a local server generate.
    kind = request.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {kind or 'none'!r}")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation(exc) from None


def _check_model(request: Request, name: str) -> ModelService:
    service = _service(request)
    if name != service.name:
        raise APIError(
            404, f"model {name!r} does not exist; this server serves {service.name!r}", "model"
        )
    return service


def _submit(request: Request, body: Body, prompts: list[list[int]], prompt_field: str,
            budget_field: str) -> EventStream:
    """Checks the context window and `n`, then queues each prompt's n choices (429 when the
    queue is full)."""
    service = _service(request)
    context = service.context_len
    longest = max(len(ids) for ids in prompts)
    if longest >= context:
        raise APIError(
            400,
            f"field '{prompt_field}': the prompt has {longest} tokens, the context window "
            f"is {context} tokens (at least one must be left to generate)",
            prompt_field,
        )
    max_tokens = body.token_budget or context - longest
    if longest + max_tokens > context:
        raise APIError(
            400,
            f"field '{budget_field}': prompt ({longest} tokens) + {budget_field} "
            f"({max_tokens}) = {longest + max_tokens} exceeds the context window of "
            f"{context} tokens",
            budget_field,
        )
    if body.n > service.slots:
        raise APIError(400, f"field 'n': {body.n} choices need as many KV slots; this server "
                       f"has {service.slots} (--max-batch)", "n")
    try:
        stream = service.submit(prompts, _params(service, body, max_tokens), body.ignore_eos,
                                body.n)
    except QueueFull as exc:
        raise APIError(429, f"server busy: {exc}; retry later") from None
    except RuntimeError as exc:
        raise APIError(503, f"server unavailable: {exc}") from None
    for ids in prompts:
        _metrics(request).prompt(len(ids))
    return stream


def _params(service: ModelService, body: Body, max_tokens: int) -> SamplingParams:
    """The request's sampling; fields it leaves out take the model's generation_config.json,
    else OpenAI's defaults."""
    model = service.llm.sampling_defaults

    def pick(value: float | None, name: str, default: float) -> float:
        return float(value if value is not None else model.get(name, default))

    top_k = body.top_k if body.top_k is not None else int(model.get("top_k", 0))
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_temperature(body.temperature if body.temperature is not None
                                 else model.get("temperature")),
        top_p=pick(body.top_p, "top_p", 1.0),
        top_k=max(top_k, 0),
        seed=body.seed,
        stop=tuple(body.stops),
        min_p=pick(body.min_p, "min_p", 0.0),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
        logprobs=body.token_logprobs,
        prompt_logprobs=body.prompt_logprobs,
    )


def _temperature(value: float | None) -> float:
    """OpenAI's default is 1; below GREEDY_BELOW it is greedy, the limit of sampling as T -> 0
    (dividing logits by a denormal temperature would overflow)."""
    if value is None:
        return 1.0
    return 0.0 if value < GREEDY_BELOW else value


def _observer(metrics: Metrics, started: float) -> Callable[[Event], None]:
    """Feeds each event's tokens to the metrics; the first one gives the time to first token."""
    first = [True]

    def observe(event: Event) -> None:
        if event.token_ids and first[0]:
            first[0] = False
            metrics.first_token(time.perf_counter() - started)
        metrics.generated(len(event.token_ids))

    return observe


async def _collect(request: Request, stream: EventStream, observe: Callable[[Event], None],
                   n: int, count: int | None = None) -> responses.Choices:
    """Every choice's whole answer; cancels the request if the client goes away while
    waiting, or when a choice fails."""
    choices = responses.Choices(count or n, n)
    check_at = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not stream.finished:
            try:
                event = await stream.next(DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() >= check_at:  # checked on a timer: events may never pause
                check_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the request") from None
            if event is None:
                continue
            observe(event)
            choices.add(event)
            _raise_for_failure(event)
    finally:
        stream.cancel()
    return choices


def _raise_for_failure(event: Event) -> None:
    if event.finish_reason == "error":
        raise APIError(500, f"generation failed: {event.error}")
    if event.finish_reason == "cancelled":
        raise APIError(503, "the server is shutting down")


def _sse(chunks: AsyncIterator[dict[str, Any]], stream: EventStream) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # the client disconnected (or the stream ended): free the slot

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(lines(), media_type="text/event-stream", headers=headers)
