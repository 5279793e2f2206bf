"""GET /v1/models/{id} through the official client, and the policy for unknown body fields:
accepted, named in the `x-hetmoe-ignored-fields` header and a log warning (as vLLM does)."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest
from live_server import MODEL, LiveServer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
IGNORED = "x-hetmoe-ignored-fields"


def test_a_model_is_retrieved_by_its_id(server: LiveServer) -> None:
    card = server.openai().models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "hetmoe")
    with pytest.raises(openai.NotFoundError) as caught:
        server.openai().models.retrieve("no-such-model")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["type"] == "not_found_error" and error["param"] == "model"
    assert error["message"] == (f"model 'no-such-model' does not exist; this server serves "
                                f"'{MODEL}'")
    assert server.api.get("/v1/models/org/name").status_code == 404  # ids with a slash route


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    ("/v1/messages", {**CHAT, "stream": False}),
])
def test_unknown_fields_are_named_as_ignored(server: LiveServer, path: str, body: dict[str, Any],
                                             caplog: pytest.LogCaptureFixture) -> None:
    plain = server.api.post(path, json=body)
    assert plain.status_code == 200, plain.text
    assert IGNORED not in plain.headers
    with caplog.at_level(logging.WARNING, logger="hetmoe.server"):
        extra = server.api.post(path, json={**body, "logit_bias": {"5": 1}, "zeta": 1,
                                            "naïve": True})
    assert extra.status_code == 200, extra.text
    assert extra.headers[IGNORED] == "logit_bias, na\\xefve, zeta"
    assert f"{path}: ignored unknown request fields: logit_bias, na\\xefve, zeta" in caplog.text


def test_the_official_client_sees_the_header(server: LiveServer) -> None:
    raw = server.openai().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"reasoning_effort_x": "high"})
    assert raw.headers[IGNORED] == "reasoning_effort_x"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
