"""The proxy against fake nodes (``fake_cluster.py``): bad input as OpenAI's 4xx errors, and node
failures (prefill faults, full and unavailable nodes, timeouts, decode dying or stalling, clients
leaving) as HTTP errors with nothing left held on the nodes."""

from __future__ import annotations

import json
import socket
import time

import grpc
import openai
import pytest
from fake_cluster import (
    ADMIN_KEY,
    API_KEY,
    LONG_PROMPT,
    MAX_MODEL_LEN,
    MODEL,
    PREFILL_TIMEOUT_S,
    TINY_VOCAB,
    TOKEN_TIMEOUT_S,
    Cluster,
    sse_events,
)
from proxy_fakes import wait_until

# --- bad input -----------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("completions", "{not json", 400, "invalid_json"),
    ("completions", [1, 2], 400, "invalid_json"),
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ("completions", {"model": MODEL, "prompt": []}, 400, None),
    ("completions", {"model": MODEL}, 400, None),
    ("completions", {"model": MODEL, "prompt": 5}, 400, None),
    ("completions", {"model": MODEL, "prompt": [5, TINY_VOCAB]}, 400, None),  # an id outside the vocabulary
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, None),
    ("completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "context_length_exceeded"),
    ("completions", {"model": MODEL, "prompt": "x", "min_tokens": 600}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "n": 129}, 400, None),
    ("completions", {"model": MODEL, "prompt": ["a"] * 65, "n": 2}, 400, None),
    ("completions", {"model": MODEL, "prompt": ["a", []]}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 3}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1}}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, None),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {str(TINY_VOCAB): 1}}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, None),
    ("chat/completions", {"model": MODEL}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                          "logprobs": True}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     None),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": False,
                          "stream_options": {"include_usage": True}}, 400, None),
    ("embeddings", {"model": MODEL, "input": "x"}, 404, "unsupported_endpoint"),
    ("audio/transcriptions", {"model": MODEL}, 404, "unsupported_endpoint"),
    ("nothing", {"model": MODEL}, 404, "not_found"),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD_REQUESTS)
def test_bad_input_is_4xx_openai_error(c: Cluster, path: str, body: object, status: int, code: str | None) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    with c.http() as h:
        r = h.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    assert c.p0.requests == [] and c.p1.requests == []  # refused before any node was asked


def test_openai_client_raises_on_bad_input(c: Cluster) -> None:
    with pytest.raises(openai.BadRequestError):
        c.client().chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        c.client().completions.create(model="other", prompt="x")


def test_unexpected_exception_is_500_openai_error(c: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def encode(self, text: str) -> list[int]:
            raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(c.app.state.proxy.serving, "tokenizer", Broken())
    with c.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal server error", "type": "server_error", "param": None,
                                 "code": "internal_error"}


def test_unknown_route_and_admin_query_errors(c: Cluster) -> None:
    with c.http() as h:
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["message"] == "/v1/nothing is not an endpoint of this server"
        r = h.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
        assert r.status_code == 404 and "does not serve embeddings" in r.json()["error"]["message"]
        r = h.get("/v1/completions")  # a known route, another method: 405 in OpenAI's shape
        assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"
    with c.http(ADMIN_KEY) as h:
        r = h.get("/admin/route", params={"prompt_tokens": "abc"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"




# --- node failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "status", "code"), [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "overloaded"),
    (grpc.StatusCode.UNAVAILABLE, 503, "node_unavailable"),
    (grpc.StatusCode.INTERNAL, 502, "node_error"),
])
def test_prefill_failure_maps_to_http(c: Cluster, fault: grpc.StatusCode, status: int, code: str) -> None:
    c.p0.fail = c.p1.fail = fault
    with c.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == status and r.json()["error"]["code"] == code
    rid = (c.p0.requests + c.p1.requests)[0].request_id
    assert wait_until(lambda: rid in c.aborts())
    assert c.d0.requests == []


def test_a_full_prefill_node_is_retried_on_another_and_all_full_is_503_retry_after(c: Cluster) -> None:
    c.p0.fail = grpc.StatusCode.RESOURCE_EXHAUSTED  # a short prompt goes to p0 first
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.choices[0].text == c.text(3)
    assert len(c.p0.requests) == 1 and len(c.p1.requests) == 1
    c.p1.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    with c.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and r.headers["Retry-After"] == "1"


def test_the_proxy_caps_requests_in_flight(c: Cluster) -> None:
    handlers = c.app.state.proxy.serving
    handlers.max_inflight, handlers.inflight = 2, 2  # as if two requests were in flight
    try:
        with c.http() as h:
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert r.headers["Retry-After"] == "1" and "max_inflight_requests" in r.json()["error"]["message"]
    finally:
        handlers.max_inflight, handlers.inflight = 0, 0
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_unavailable_prefill_node_is_retried_on_another(c: Cluster) -> None:
    c.p0.fail = grpc.StatusCode.UNAVAILABLE  # a short prompt goes to p0 first
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.choices[0].text == c.text(3)
    assert len(c.p0.requests) == 1 and len(c.p1.requests) == 1
    assert wait_until(lambda: c.p0.requests[0].request_id in c.p0.aborts)


def test_prefill_timeout_is_503_and_aborts(c: Cluster) -> None:
    c.p0.stall_s = c.p1.stall_s = PREFILL_TIMEOUT_S + 0.5  # past the proxy's prefill_timeout_s
    with c.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "timeout"
    # The proxy aborts the prefill it gave up on. (On a loaded machine the call can time out
    # before the fake node has even recorded it: the abort is sent either way.)
    assert wait_until(lambda: len(c.aborts()) >= 1)
    assert all(q.request_id in c.aborts() for q in c.p0.requests + c.p1.requests)


def test_decode_dies_mid_stream(c: Cluster) -> None:
    c.d0.fail_after = 2
    with c.http() as h, h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "node_unavailable" and "UNAVAILABLE" in error["message"]
    assert len(events) >= 2  # some text came before the failure
    rid = c.d0.requests[0].request_id
    assert wait_until(lambda: rid in c.aborts())


def test_decode_dies_non_streaming(c: Cluster) -> None:
    c.d0.fail_after = 1
    with c.http() as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "node_unavailable"
    assert wait_until(lambda: c.d0.requests[0].request_id in c.aborts())


def test_decode_stall_hits_token_timeout(c: Cluster) -> None:
    c.d0.stall_after = 1
    t0 = time.monotonic()
    with c.http() as h, h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}) as r:
        events = sse_events(r)
    assert time.monotonic() - t0 < TOKEN_TIMEOUT_S + 3
    assert json.loads(events[-1])["error"]["code"] == "token_timeout"
    rid = c.d0.requests[0].request_id
    assert wait_until(lambda: rid in c.d0.cancelled and rid in c.aborts())


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_decode_and_aborts(c: Cluster, stream: bool) -> None:
    c.d0.delay_s = 0.1
    c.d0.tokens_per_event = 1
    body = json.dumps({"model": MODEL, "prompt": "x", "stream": stream}).encode()
    host, port = c.url.removeprefix("http://").split(":")
    # A raw socket: hang up exactly when decode is under way, whatever the machine's speed.
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: len(c.d0.requests) == 1)
        time.sleep(0.15)
    rid = c.d0.requests[0].request_id
    assert wait_until(lambda: rid in c.d0.cancelled), "the decode stream was not cancelled"
    assert wait_until(lambda: rid in c.aborts()), "no Abort reached the prefill node"
    assert rid not in c.d0.finished
