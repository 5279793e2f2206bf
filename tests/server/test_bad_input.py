"""Every bad input gets its status and a message naming the field; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from live_server import API_KEY, MODEL, LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}).encode()


# (route, raw body, status, param, message fragment)
CASES = [
    (CHAT, b'{"model": "tiny-moe", "messages": [', 400, None, "request body is not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "request body: Input should be an object"),
    (CHAT, b'{"model": "tiny-moe"}', 400, "messages", "field 'messages': Field required"),
    (CHAT, chat(messages=[]), 400, "messages", "field 'messages': List should have at least 1"),
    (CHAT, chat(messages="Hi"), 400, "messages", "field 'messages': Input should be a valid array"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     "field 'messages[0].content': Input should be a valid"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role",
     "field 'messages[0].role': Input should be 'system'"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role",
     "field 'messages[0].role': Field required"),
    (CHAT, json.dumps({"messages": USER}).encode(), 400, "model", "field 'model': Field required"),
    (CHAT, chat(model=7), 400, "model", "field 'model': Input should be a valid string"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens",
     "field 'max_tokens': Input should be a valid integer (got '5')"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens",
     "field 'max_tokens': Input should be greater than or equal to 1 (got -1)"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, chat(max_tokens=10**12), 400, "max_tokens",
     "field 'max_tokens': Input should be less than or equal to 1048576"),
    (CHAT, chat(max_tokens=250), 400, "max_tokens",
     "+ max_tokens (250) = 259 exceeds the context window of 256 tokens"),
    (CHAT, chat(max_tokens=None, max_completion_tokens=255), 400, "max_completion_tokens",
     "field 'max_completion_tokens': prompt (9 tokens) + max_completion_tokens (255)"),
    (CHAT, chat(messages=[{"role": "user", "content": "the sea " * 200}]), 400, "messages",
     "the context window is 256 tokens"),
    (CHAT, chat(max_completion_tokens=-4), 400, "max_completion_tokens", "greater than or equal"),
    (CHAT, chat(temperature=-0.5), 400, "temperature",
     "field 'temperature': Input should be greater than or equal to 0"),
    (CHAT, chat(temperature=1e9), 400, "temperature", "less than or equal to 2"),
    (CHAT, chat(temperature="hot"), 400, "temperature", "Input should be a valid number"),
    (CHAT, chat(top_p=0), 400, "top_p", "field 'top_p': Input should be greater than 0"),
    (CHAT, chat(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    (CHAT, chat(top_k=-7), 400, "top_k", "field 'top_k': Input should be greater than or equal"),
    (CHAT, chat(seed=2**80), 400, "seed", "field 'seed': Input should be less than or equal"),
    (CHAT, chat(seed=1.5), 400, "seed", "field 'seed': Input should be a valid integer"),
    (CHAT, chat(stop=list("abcdefghijklmnopq")), 400, "stop", "at most 16 stop strings, got 17"),
    (CHAT, chat(stop=[""]), 400, "stop", "each stop string must have 1 to 256 characters"),
    (CHAT, chat(stop=7), 400, "stop", "field 'stop'"),
    (CHAT, chat(stream="yes"), 400, "stream", "field 'stream': Input should be a valid boolean"),
    (CHAT, chat(stream_options=True), 400, "stream_options", "field 'stream_options'"),
    (CHAT, chat(n=9), 400, "n", "field 'n': 9 choices need as many KV slots; this server has 8"),
    (CHAT, chat(n=0), 400, "n", "field 'n': Input should be greater than or equal to 1 (got 0)"),
    (CHAT, chat(n=1000), 400, "n", "field 'n': Input should be less than or equal to 128"),
    (CHAT, chat(n="3"), 400, "n", "field 'n': Input should be a valid integer"),
    (CHAT, chat(logprobs="yes"), 400, "logprobs",
     "field 'logprobs': Input should be a valid boolean (got 'yes')"),
    (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "field 'top_logprobs': Input should be less than or equal to 20 (got 21)"),
    (CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs",
     "field 'top_logprobs': Input should be greater than or equal to 0"),
    (CHAT, chat(top_logprobs=3), 400, "top_logprobs",
     "field 'top_logprobs': Value error, top_logprobs needs logprobs set to true"),
    (CHAT, chat(presence_penalty=2.5), 400, "presence_penalty",
     "field 'presence_penalty': Input should be less than or equal to 2 (got 2.5)"),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty",
     "field 'frequency_penalty': Input should be greater than or equal to -2"),
    (CHAT, chat(frequency_penalty="high"), 400, "frequency_penalty", "valid number"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty",
     "field 'repetition_penalty': Input should be greater than 0 (got 0)"),
    (CHAT, chat(repetition_penalty=11), 400, "repetition_penalty", "less than or equal to 10"),
    (CHAT, chat(min_p=1.5), 400, "min_p", "field 'min_p': Input should be less than or equal to 1"),
    (CHAT, chat(min_p=-0.1), 400, "min_p", "greater than or equal to 0"),
    (CHAT, chat(model="gpt-4"), 404, "model",
     "model 'gpt-4' does not exist; this server serves 'tiny-moe'"),
    (COMPLETIONS, completion(prompt=""), 400, "prompt", "field 'prompt'"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt", "field 'prompt'"),
    (COMPLETIONS, completion(prompt=[1, 99999]), 400, "prompt",
     "field 'prompt': token ids must be in [0, 512)"),
    (COMPLETIONS, completion(prompt={"text": "x"}), 400, "prompt", "field 'prompt'"),
    (COMPLETIONS, completion(max_tokens=256), 400, "max_tokens", "exceeds the context window"),
    (COMPLETIONS, completion(echo="yes"), 400, "echo", "field 'echo': Input should be a valid"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens",
     "field 'max_tokens': 0 generates nothing; it is served only with echo: true"),
    (COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens", "greater than or equal to 0"),
    (COMPLETIONS, completion(logprobs=6), 400, "logprobs",
     "field 'logprobs': Input should be less than or equal to 5 (got 6)"),
    (COMPLETIONS, completion(logprobs=-1), 400, "logprobs", "greater than or equal to 0"),
    (COMPLETIONS, completion(logprobs=True), 400, "logprobs", "valid integer"),
    (COMPLETIONS, completion(prompt=[[1, 2], [3, 99999]]), 400, "prompt[1]",
     "field 'prompt[1]': token ids must be in [0, 512)"),
    (COMPLETIONS, completion(prompt=[[1, 2], []]), 400, "prompt", "field 'prompt"),
    (COMPLETIONS, completion(prompt=["a", ""]), 400, "prompt", "field 'prompt"),
    (COMPLETIONS, completion(prompt=[[1]] * 257), 400, "prompt", "field 'prompt'"),
    (COMPLETIONS, completion(n=3, prompt=["a", "b b b"], max_tokens=254), 400, "max_tokens",
     "exceeds the context window"),
    (COMPLETIONS, completion(model="other"), 404, "model", "model 'other' does not exist"),
]


def _good_request_succeeds(server: LiveServer) -> None:
    reply = server.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("route", "body", "status", "param", "message"), CASES)
def test_bad_body_is_refused_by_field(
    server: LiveServer, route: str, body: bytes, status: int, param: str | None, message: str
) -> None:
    response = server.api.post(route, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    _good_request_succeeds(server)


def test_openai_client_sees_the_message(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.openai().chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert "field 'messages': List should have at least 1 item" in caught.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        server.openai().chat.completions.create(model="nope", messages=USER, max_tokens=2)
    assert "model 'nope' does not exist" in missing.value.message
    _good_request_succeeds(server)


def test_body_size_is_bounded(server: LiveServer) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * 70_000}])
    response = server.api.post(CHAT, content=big)
    assert response.status_code == 413
    assert response.json()["error"]["message"] == (
        f"request body too large: {len(big)} bytes, the limit is 65536 bytes"
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        for _ in range(70):
            yield b"x" * 1000

    streamed = server.api.post(CHAT, content=chunks())
    assert streamed.status_code == 413
    assert "the limit is 65536 bytes" in streamed.json()["error"]["message"]
    _good_request_succeeds(server)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic dGVzdC1rZXk=", f"bearer{API_KEY}"])
def test_api_key_is_required_on_every_route_but_health(
    server: LiveServer, header: str | None
) -> None:
    headers = {"Authorization": header} if header else {}
    with server.http(key=None) as http:
        for method, path in [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS),
                             ("GET", "/metrics"), ("GET", "/v1/nothing")]:
            response = http.request(method, path, content=chat(), headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert response.json()["error"]["message"] == (
                "missing or invalid API key: send 'Authorization: Bearer <key>'"
            )
            assert response.headers["www-authenticate"] == "Bearer"
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    _good_request_succeeds(server)


@pytest.mark.parametrize("kind", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_only_json_bodies_are_read(server: LiveServer, kind: str | None) -> None:
    headers = {"Content-Type": kind} if kind else {}
    response = server.api.post(CHAT, content=chat(), headers=headers)
    assert response.status_code == 415
    shown = repr(kind) if kind else "'none'"
    assert response.json()["error"]["message"] == (
        f"Content-Type must be application/json, got {shown}"
    )
    charset = server.api.post(CHAT, content=chat(),
                              headers={"Content-Type": "application/json; charset=utf-8"})
    assert charset.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "10.0.0.7"])
def test_a_loopback_server_answers_loopback_host_names_only(server: LiveServer, host: str) -> None:
    refused = server.api.get("/health", headers={"Host": host})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        f"Host {host.split(':')[0]!r} is not served here: this server answers to "
        "127.0.0.1, ::1, [::1], localhost"
    )
    port = server.url.rsplit(":", 1)[1]
    for good in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert server.api.get("/health", headers={"Host": good}).status_code == 200
    _good_request_succeeds(server)


def test_unknown_route_and_wrong_method(server: LiveServer) -> None:
    missing = server.api.get("/v1/../../etc/passwd")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    wrong = server.api.get(CHAT)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "Method Not Allowed"
    assert server.api.get("/static/../server/api.py").status_code == 404
    _good_request_succeeds(server)
