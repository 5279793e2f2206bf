"""Tokenizer routes as vLLM serves them: `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info`.

Evaluators count a prompt's tokens with the server's own tokenizer through these (lm-evaluation-
harness's `local-completions` probes them and, when they answer, needs no local copy of the
tokenizer), so log-likelihood tasks split context and continuation exactly as the model reads them.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import Field

from hetmoe.server import protocol
from hetmoe.server.api import check_model, parse_body
from hetmoe.server.errors import APIError
from hetmoe.server.service import ModelService

router = APIRouter()
MAX_DETOKENIZE = 1 << 20
"""Token ids of one /detokenize request at most."""


class TokenizeRequest(protocol._Request):
    """POST /tokenize: text, with or without the tokenizer's usual special tokens."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(protocol._Request):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_DETOKENIZE)]


def _checked(request: Request, model: str | None) -> tuple[ModelService, Any]:
    """The service and its tokenizer (a 404 for another model, a 400 without a tokenizer)."""
    service: ModelService = request.app.state.service
    if model is not None:
        check_model(request, model)
    if service.tokenizer is None:
        raise APIError(400, f"model {service.name!r} has no tokenizer: send token ids")
    return service, service.tokenizer


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens"}` of the prompt."""
    body = await parse_body(request, TokenizeRequest)
    service, _ = _checked(request, body.model)
    tokens = service.text_ids(body.prompt, body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": service.context_len, "tokens": tokens,
            "token_strs": None}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """`{"prompt"}`: the text of the ids (special tokens dropped, as in completions)."""
    body = await parse_body(request, DetokenizeRequest)
    service, _ = _checked(request, body.model)
    vocab = service.runner.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"field 'tokens': token ids must be in [0, {vocab}), got {bad}",
                       "tokens")
    return {"prompt": service.text(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and lengths."""
    service, tokenizer = _checked(request, None)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": service.chat_template,
        "model_max_length": service.context_len,
        "vocab_size": service.runner.vocab_size,
    }
