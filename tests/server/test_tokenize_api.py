"""vLLM's tokenizer routes (`/tokenize`, `/detokenize`, `/tokenizer_info`), which evaluators
such as lm-evaluation-harness's `local-completions` use instead of a local tokenizer."""

from __future__ import annotations

import pytest
from live_server import MODEL, LiveServer


def test_tokenize_equals_the_model_tokenizer(server: LiveServer) -> None:
    tokenizer = server.service.tokenizer
    text = "The capital of France is Paris."
    plain = server.api.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert plain.status_code == 200, plain.text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert plain.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                            "token_strs": None}
    usual = server.api.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert usual["tokens"] == tokenizer.encode(text)


def test_detokenize_round_trips(server: LiveServer) -> None:
    ids = server.api.post("/tokenize", json={"prompt": "one two three"}).json()["tokens"]
    reply = server.api.post("/detokenize", json={"tokens": ids})
    assert reply.status_code == 200 and reply.json() == {"prompt": "one two three"}


def test_tokenizer_info_names_special_tokens_and_template(server: LiveServer) -> None:
    info = server.api.get("/tokenizer_info").json()
    tokenizer = server.service.tokenizer
    assert info["eos_token"] == tokenizer.eos_token
    assert info["pad_token"] == tokenizer.pad_token
    assert info["chat_template"] == server.service.chat_template
    assert info["model_max_length"] == 256
    assert info["vocab_size"] == server.service.runner.vocab_size


def test_lm_eval_detects_the_remote_tokenizer(server: LiveServer) -> None:
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    base = server.url + "/v1/completions"
    assert lm_eval_utils.check_remote_tokenizer_support(base, auth_token="test-key")
    remote = lm_eval_utils.RemoteTokenizer(base, auth_token="test-key")
    assert remote.encode("hello world") == server.service.tokenizer.encode(
        "hello world", add_special_tokens=False)
    assert remote.eos_token_id == server.service.tokenizer.eos_token_id


@pytest.mark.parametrize(("route", "body", "status", "message"), [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model 'other' does not exist"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "token ids must be in [0,"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(server: LiveServer, route: str, body: dict,
                                              status: int, message: str) -> None:
    reply = server.api.post(route, json=body)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]
    assert server.api.get("/health").status_code == 200


def test_routes_need_the_key(server: LiveServer) -> None:
    with server.http(key=None) as anonymous:
        assert anonymous.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert anonymous.get("/tokenizer_info").status_code == 401
