"""Routes: /v1/models[/ID], /v1/chat/completions, /v1/completions, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from hetmoe.engine.requests.constrained import ResponseFormat
from hetmoe.engine.requests.request import Event, QueueFull
from hetmoe.engine.requests.sampler import SamplingParams
from hetmoe.server import protocol, responses, tools
from hetmoe.server.errors import APIError, from_validation
from hetmoe.server.metrics import Metrics
from hetmoe.server.notices import notice_headers
from hetmoe.server.sampling import request_sampling
from hetmoe.server.service import EventStream, ModelService

router = APIRouter()
# How often a non-streaming request checks whether its client is still there, seconds.
DISCONNECT_POLL_S = 0.05
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
    """The model this server serves, then its LoRA adapters (each a `model` name)."""
    service = _service(request)
    names = (service.name, *service.adapters)
    return {"object": "list", "data": [protocol.model_card(n, service.created) for n in names]}


@router.get("/v1/models/{name:path}")
async def model(request: Request, name: str) -> dict[str, Any]:
    """One model of the list by its id (a 404 naming the served ones for another)."""
    service = check_model(request, name)
    return protocol.model_card(name, service.created)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI chat completions, streamed as SSE when `stream` is true."""
    started = time.perf_counter()
    body = await parse_body(request, protocol.ChatCompletionRequest)
    service = check_model(request, body.model)
    plan = tools.plan_tools(body, service.chat_template)
    prompt_ids = tools.render_chat(service, body.messages, plan)
    budget = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    fmt = await response_format(service, body)
    if fmt is None and plan is not None:
        fmt = await compiled(service, plan.forced(), "tools")
    stream = _submit(request, body, [prompt_ids], "messages", (budget, body.token_budget), fmt)
    rid = protocol.new_id("chatcmpl")
    observe = observer(_metrics(request), started)
    headers = notice_headers(request.url.path, body, plan)
    if body.stream:
        return _sse(responses.chat_chunks(rid, body, stream, observe, service.token_text,
                                          body.n, plan), stream, headers)
    choices = await collect(request, stream, observe, body.n)
    return JSONResponse(responses.chat_body(rid, service.name, choices, bool(body.logprobs),
                                            service.token_text, plan), headers=headers)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> JSONResponse | StreamingResponse:
    """OpenAI text completions of one prompt or several (text or token ids), in
    `response_format` when given. `max_tokens: 0` with `echo` scores the prompt only (one token
    is generated and dropped, as vLLM does)."""
    started = time.perf_counter()
    body = await parse_body(request, protocol.CompletionRequest)
    service = check_model(request, body.model)
    prompt_only = body.max_tokens == 0
    if prompt_only and not body.echo:
        raise APIError(400, "field 'max_tokens': 0 generates nothing; it is served only with "
                       "echo: true (the prompt and its logprobs, for log-likelihoods)",
                       "max_tokens")
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
    fmt = await response_format(service, body)
    budget = 1 if prompt_only else body.max_tokens
    stream = _submit(request, body, prompts, "prompt", ("max_tokens", budget), fmt)
    echo = None
    if body.echo:
        echo = [(p if isinstance(p, str) else service.text(ids), ids)
                for p, ids in zip(body.prompts, prompts, strict=True)]
    rid = protocol.new_id("cmpl")
    observe = observer(_metrics(request), started)
    count = len(prompts) * body.n
    headers = notice_headers(request.url.path, body, None)
    if body.stream:
        return _sse(responses.completion_chunks(rid, body, stream, observe, service.token_text,
                                                count, echo, prompt_only), stream, headers)
    choices = await collect(request, stream, observe, body.n, count)
    return JSONResponse(responses.completion_body(rid, service.name, choices,
                                                  body.logprobs is not None, echo,
                                                  service.token_text, prompt_only),
                        headers=headers)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    # JSON only: a browser page of another site cannot send it without a CORS preflight, which
    # this server never grants, so no web page can make a local server generate.
    kind = request.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {kind or 'none'!r}")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_validation(exc) from None


def check_model(request: Request, name: str) -> ModelService:
    service = _service(request)
    if name != service.name and name not in service.adapters:
        served = ", ".join(repr(n) for n in (service.name, *service.adapters))
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}",
                       "model")
    return service


async def response_format(service: ModelService, body: Body) -> ResponseFormat | None:
    """The request's `response_format` with its index built and cached for the scheduler; a
    400 naming the field when the format is not JSON the library can follow."""
    if body.response_format is None:
        return None
    try:
        fmt = ResponseFormat.of(body.response_format.model_dump(exclude_none=True))
    except ValueError as exc:
        message = str(exc).removeprefix("response_format: ")
        raise APIError(400, f"field 'response_format': {message}", "response_format") from None
    return await compiled(service, fmt, "response_format")


async def compiled(service: ModelService, fmt: ResponseFormat | None,
                   field: str) -> ResponseFormat | None:
    """`fmt` with its index built (in a worker thread: a large schema takes seconds) and
    cached for the scheduler; a 400 naming `field` when it cannot be followed."""
    if fmt is None:
        return None
    try:
        await asyncio.to_thread(service.llm.constraints.compile, fmt)
    except ValueError as exc:
        message = str(exc).removeprefix("response_format: ")
        raise APIError(400, f"field '{field}': {message}", field) from None
    return fmt


def _submit(request: Request, body: Body, prompts: list[list[int]], prompt_field: str,
            budget: tuple[str, int | None], fmt: ResponseFormat | None = None) -> EventStream:
    """Checks the context window against `budget` (the field, tokens or None for all the
    window left) and `n`, then queues each prompt's n choices, answering in `fmt` (429 when the
    queue is full)."""
    service = _service(request)
    budget_field, tokens = budget
    max_tokens = check_window(service, max(len(ids) for ids in prompts), tokens, prompt_field,
                              budget_field)
    if body.n > service.slots:
        raise APIError(400, f"field 'n': {body.n} choices need as many KV slots; this server "
                       f"has {service.slots} (--max-batch)", "n")
    try:
        stream = service.submit(prompts, _params(service, body, max_tokens, fmt),
                                body.ignore_eos, body.n)
    except QueueFull as exc:
        raise APIError(429, f"server busy: {exc}; retry later") from None
    except RuntimeError as exc:
        raise APIError(503, f"server unavailable: {exc}") from None
    for ids in prompts:
        _metrics(request).prompt(len(ids))
    return stream


def check_window(service: ModelService, longest: int, budget: int | None, prompt_field: str,
                 budget_field: str) -> int:
    """The token budget of a prompt of `longest` tokens (all the window left when `budget` is
    None); a 400 naming the field when the prompt or prompt + budget exceed the window."""
    context = service.context_len
    if longest >= context:
        raise APIError(
            400,
            f"field '{prompt_field}': the prompt has {longest} tokens, the context window "
            f"is {context} tokens (at least one must be left to generate)",
            prompt_field,
        )
    max_tokens = budget or context - longest
    if longest + max_tokens > context:
        raise APIError(
            400,
            f"field '{budget_field}': prompt ({longest} tokens) + {budget_field} "
            f"({max_tokens}) = {longest + max_tokens} exceeds the context window of "
            f"{context} tokens",
            budget_field,
        )
    return max_tokens


def _params(service: ModelService, body: Body, max_tokens: int,
            fmt: ResponseFormat | None) -> SamplingParams:
    return request_sampling(
        service.llm.sampling_defaults, max_tokens, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, stop=body.stops, seed=body.seed, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logprobs=body.token_logprobs,
        prompt_logprobs=body.prompt_logprobs, adapter=service.adapter_of(body.model),
        response_format=fmt)


def observer(metrics: Metrics, started: float) -> Callable[[Event], None]:
    """Feeds each event's tokens to the metrics; the first one gives the time to first token."""
    first = [True]

    def observe(event: Event) -> None:
        if event.token_ids and first[0]:
            first[0] = False
            metrics.first_token(time.perf_counter() - started)
        metrics.generated(len(event.token_ids))

    return observe


async def collect(request: Request, stream: EventStream, observe: Callable[[Event], None],
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


def _sse(chunks: AsyncIterator[dict[str, Any]], stream: EventStream,
         notices: dict[str, str]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            stream.cancel()  # the client disconnected (or the stream ended): free the slot

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **notices}
    return StreamingResponse(lines(), media_type="text/event-stream", headers=headers)
