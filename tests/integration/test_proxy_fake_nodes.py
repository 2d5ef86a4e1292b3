"""The proxy end to end against fake prefill/decode gRPC nodes, through the official openai client.

One proxy (uvicorn in a thread) and three fake nodes (grpc.aio servers on a background loop) serve
the whole module; each test resets the fakes' knobs and records.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from proxy_fakes import (
    FakeDecode,
    FakeNodes,
    FakePrefill,
    Script,
    node_state,
    running_proxy,
    settled,
    wait_until,
)

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.discovery import StaticNodeSource

MODEL = "tiny-test"
MAX_MODEL_LEN = 512
API_KEY = "sk-test"
ADMIN_KEY = "admin-test"
# Multi-byte characters (2, 3 and 4 bytes) split across byte-level tokens, and words for stop strings.
SCRIPT_TEXT = "Hello world! The cluster serves héllo 日本 🎉 tokens quickly."


@dataclass
class Cluster:
    url: str
    tokenizer: Tokenizer
    script: Script
    p0: FakePrefill  # PCP 1
    p1: FakePrefill  # PCP 2
    d0: FakeDecode
    source: StaticNodeSource
    app: object

    @property
    def prefills(self) -> list[FakePrefill]:
        return [self.p0, self.p1]

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=10, **kw)

    def http(self, key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def aborts(self) -> list[str]:
        return self.p0.aborts + self.p1.aborts

    def text(self, n: int | None = None) -> str:
        ids = self.script.tokens if n is None else [self.script.token_at(i) for i in range(n)]
        return self.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode(SCRIPT_TEXT, add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p0, p1, d0 = FakePrefill("p0", script), FakePrefill("p1", script), FakeDecode("d0", script)
        source = StaticNodeSource([
            node_state("p0", "prefill", fakes.serve(p0), model=MODEL, max_model_len=MAX_MODEL_LEN, pcp=1),
            node_state("p1", "prefill", fakes.serve(p1), model=MODEL, max_model_len=MAX_MODEL_LEN, pcp=2),
            node_state("d0", "decode", fakes.serve(d0), model=MODEL, max_model_len=MAX_MODEL_LEN),
        ])
        config = ProxyConfig(model=str(tiny_model), served_model_name=MODEL, api_key=API_KEY, admin_key=ADMIN_KEY,
                             prefill_timeout_s=1.0, token_timeout_s=0.5)
        with running_proxy(config, tok, source) as (url, app):
            yield Cluster(url, tok, script, p0, p1, d0, source, app)
    finally:
        fakes.stop()


@pytest.fixture
def c(cluster: Cluster) -> Iterator[Cluster]:
    for node_id in ("p0", "p1", "d0"):
        cluster.source.set_draining(node_id, False)
    with settled(cluster.app, cluster.prefills, [cluster.d0]):
        yield cluster


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# --- happy paths ---------------------------------------------------------------------------------


def test_completion_length_and_usage(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt="The cluster", max_tokens=5, temperature=0)
    prompt_len = len(c.tokenizer.encode("The cluster"))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == c.text(5)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 5, prompt_len + 5)
    sent = c.d0.requests[-1]
    assert sent.sampling.max_tokens == 5 and sent.sampling.temperature == 0
    assert list(sent.prompt_token_ids) == c.tokenizer.encode("The cluster")
    (prefill,) = [p for p in (c.p0, c.p1) if any(r.request_id == sent.request_id for r in p.requests)]
    assert sent.kv.prefill_address == prefill.address  # copied from the Prefill answer


def test_vllm_kv_params_are_copied_to_the_decode_request(c: Cluster) -> None:
    c.p0.vllm_params = c.p1.vllm_params = True  # as vLLM prefill nodes answer (the fixture resets them)
    r = c.client().completions.create(model=MODEL, prompt="The cluster", max_tokens=5, temperature=0)
    assert r.choices[0].text == c.text(5)
    sent = c.d0.requests[-1]
    (prefill,) = [p for p in (c.p0, c.p1) if any(r.request_id == sent.request_id for r in p.requests)]
    assert not sent.HasField("kv")  # one KV source, as the Prefill answer had
    assert json.loads(sent.vllm_kv_params_json) == {"fake": sent.request_id, "release_to": prefill.address}


def test_completion_runs_to_eos(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=MAX_MODEL_LEN - 3)
    assert r.choices[0].text == SCRIPT_TEXT  # EOS is not in the text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(c.script.tokens) + 1  # EOS counted


def test_completion_max_tokens_defaults_to_16_like_openai(c: Cluster) -> None:
    c.client().completions.create(model=MODEL, prompt=[5, 6, 7])
    assert c.d0.requests[-1].sampling.max_tokens == 16


def test_chat_runs_up_to_the_context_limit_by_default(c: Cluster) -> None:
    c.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    decode = c.d0.requests[-1]
    (prefill,) = [r for r in c.p0.requests + c.p1.requests if r.request_id == decode.request_id]
    assert decode.sampling.max_tokens == MAX_MODEL_LEN - len(prefill.token_ids)


def test_chat_non_streaming(c: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    r = c.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=40)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == SCRIPT_TEXT
    assert r.usage.prompt_tokens == len(c.tokenizer.apply_chat_template(messages))


def test_chat_text_parts_are_joined(c: Cluster) -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]
    c.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=2)
    expected = c.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello"}])
    assert list(c.p0.requests[-1].token_ids if c.p0.requests else c.p1.requests[-1].token_ids) == expected


def test_chat_streaming_with_usage(c: Cluster) -> None:
    stream = c.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == SCRIPT_TEXT
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(c.script.tokens) + 1
    assert all("\ufffd" not in (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)


def test_completion_streaming_matches_non_streaming(c: Cluster) -> None:
    client = c.client()
    whole = client.completions.create(model=MODEL, prompt="x", max_tokens=30).choices[0].text
    pieces = [ch.choices[0].text for ch in client.completions.create(model=MODEL, prompt="x", max_tokens=30,
                                                                       stream=True)]
    assert "".join(pieces) == whole == c.text(30)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(c: Cluster, stream: bool) -> None:
    client = c.client()
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt="x", stop=["日本", "zzz"], stream=True,
                                                  max_tokens=200))
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(model=MODEL, prompt="x", stop="日本", max_tokens=200)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        # completion_tokens counts up to and including the token that completed the stop string
        ids = c.script.tokens
        n = next(k for k in range(1, len(ids) + 1) if "日本" in c.tokenizer.decode(ids[:k]))
        assert r.usage.completion_tokens == n
    assert text == SCRIPT_TEXT[:SCRIPT_TEXT.index("日本")]
    assert finish == "stop"


def test_first_token_ends_request_without_decode(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    assert r.choices[0].text == c.text(1)
    assert c.d0.requests == [] and c.aborts() == []


def test_completion_logprobs_shape(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(-0.1)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_return_tokens_as_token_ids_names_each_token_by_its_id(c: Cluster) -> None:
    """vLLM's extension: a client that must know the ids (a multi-turn prompt of ids) gets them."""
    ids = {"return_tokens_as_token_ids": True}
    r = c.client().completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=1, extra_body=ids)
    plain = c.client().completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens)
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp.top_logprobs for t in top)
    assert lp.text_offset == plain.choices[0].logprobs.text_offset and r.choices[0].text == plain.choices[0].text
    chat = c.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              logprobs=True, extra_body=ids)
    assert all(re.fullmatch(r"token_id:\d+", e.token) for e in chat.choices[0].logprobs.content)


def test_penalties_bias_and_min_p_reach_the_nodes(c: Cluster) -> None:
    c.client().completions.create(model=MODEL, prompt="x", max_tokens=3, presence_penalty=0.5, frequency_penalty=-1.25,
                                  logit_bias={"7": -100, "9": 2.5},
                                  extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    sent = [r for p in (c.p0, c.p1) for r in p.requests][-1].sampling
    assert (sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty, sent.min_p) == (0.5, -1.25, 1.3,
                                                                                                  0.05)
    assert dict(sent.logit_bias) == {7: -100.0, 9: 2.5}


def test_n_samples_and_several_prompts_are_choices_with_their_own_seeds(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt=["x", "yy"], max_tokens=4, n=3, seed=7)
    assert [ch.index for ch in r.choices] == list(range(6))
    assert all(ch.text == c.text(4) and ch.finish_reason == "length" for ch in r.choices)
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(c.tokenizer.encode("x")) + len(c.tokenizer.encode("yy"))  # once per prompt
    seeds = {int(q.request_id.rsplit("-", 1)[1]): q.sampling.seed for p in (c.p0, c.p1) for q in p.requests
             if q.request_id.startswith(r.id + "-")}  # each choice is a request of its own: <id>-<index>
    assert seeds == {k: 7 + k % 3 for k in range(6)}  # sample i of each prompt: seed + i (vLLM's rule)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_samples_stream_as_indexed_chunks(c: Cluster, endpoint: str) -> None:
    if endpoint == "chat":
        chunks = list(c.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=5, n=2, stream=True,
                                                         stream_options={"include_usage": True}))
        texts = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks
                            if ch.choices and ch.choices[0].index == i) for i in range(2)}
    else:
        chunks = list(c.client().completions.create(model=MODEL, prompt="x", max_tokens=5, n=2, stream=True,
                                                    stream_options={"include_usage": True}))
        texts = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
                 for i in range(2)}
    assert texts == {0: c.text(5), 1: c.text(5)}
    finished = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_echo_puts_the_prompt_before_the_answer(c: Cluster) -> None:
    r = c.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True)
    assert r.choices[0].text == "Hello" + c.text(3)
    chunks = list(c.client().completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2, echo=True,
                                                stream=True))
    for i, p in enumerate(("Hi", "Yo")):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == p + c.text(2)


@pytest.mark.parametrize("stream", [False, True])
def test_choices_cut_by_a_stop_string_stop_decoding_on_the_node(c: Cluster, stream: bool) -> None:
    """Each choice's decode stream is cancelled once its stop string arrives (the script goes on)."""
    c.d0.delay_s = 0.05  # every event: the script is still streaming when the stop string completes
    try:
        r = c.client().completions.create(model=MODEL, prompt="x", stop="日本", max_tokens=200, n=2, stream=stream)
        choices = [ch.choices[0] for ch in r if ch.choices] if stream else r.choices
        texts = ["".join(x.text for x in choices if x.index == i) for i in range(2)]
    finally:
        c.d0.delay_s = 0.0
    assert texts == 2 * [SCRIPT_TEXT[:SCRIPT_TEXT.index("日本")]]
    assert wait_until(lambda: len(c.d0.cancelled) >= 2, timeout_s=5)
    assert len({rid.rsplit("-", 1)[0] for rid in c.d0.cancelled[-2:]}) == 1  # both choices of that request


def test_n_too_large_for_the_decode_nodes_kv_is_a_400(c: Cluster) -> None:
    r = c.http().post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 500, "n": 128})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(c: Cluster) -> None:
    chunks = list(c.client().completions.create(
        model=MODEL, prompt="x", max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counted == sorted(counted) and counted[-1] == 5 and all(ch.usage is not None for ch in chunks)
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices  # the usage chunk, as before


def test_tokenize_and_detokenize_as_vllm_serves_them(c: Cluster) -> None:
    tok, http = c.tokenizer, c.http()
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    chat = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": chat, "return_token_strs": True}).json()
    assert r["tokens"] == tok.apply_chat_template(chat) and len(r["token_strs"]) == r["count"]
    back = http.post("/detokenize", json={"tokens": tok.encode("Hello there", add_special_tokens=False)}).json()
    assert back == {"prompt": "Hello there"}
    for path, body in (("tokenize", {}), ("tokenize", {"prompt": "a", "messages": chat}),
                       ("detokenize", {"tokens": [TINY_VOCAB]}), ("detokenize", {"tokens": [-1]})):
        r = http.post(f"/{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, body, r.text)
    assert c.http(key=None).post("/tokenize", json={"prompt": "a"}).status_code == 401  # behind the API key


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_shape(c: Cluster, stream: bool) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True, top_logprobs=3)
    if stream:
        entries = [e for ch in c.client().chat.completions.create(stream=True, **kw)
                   if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    else:
        entries = c.client().chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert isinstance(e.token, str) and e.logprob < 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob


def test_models_and_health(c: Cluster) -> None:
    models = c.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    with c.http(None) as h:
        r = h.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": MODEL, "prefill": 2, "decode": 1,
                                                 "local_prefill": False, "registry": "ok"}


# --- bad input -----------------------------------------------------------------------------------

LONG_PROMPT = list(range(10, 10 + MAX_MODEL_LEN))
TINY_VOCAB = 1024  # >= the tiny model's vocab_size (pdctl/tiny_model.py trains at most 1024 tokens)
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
        assert r.status_code == 404 and "error" in r.json()
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
    c.p0.stall_s = c.p1.stall_s = 1.5  # past the proxy's prefill_timeout_s of 1 s
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
    assert time.monotonic() - t0 < 3
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


# --- admin, drain, routing -----------------------------------------------------------------------


def test_drain_stops_routing_at_once(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        r = admin.post("/admin/nodes/p1/drain")
        assert r.status_code == 200 and r.json() == {"node_id": "p1", "draining": True}
        nodes = {n["node_id"]: n for n in admin.get("/admin/nodes").json()["nodes"]}
        assert nodes["p1"]["draining"] is True and nodes["p0"]["draining"] is False
        assert {"inflight", "replicas", "healthy", "pcp", "address"} <= set(nodes["p0"])
        client = c.client()
        for _ in range(4):
            client.completions.create(model=MODEL, prompt=LONG_PROMPT[:400], max_tokens=2)  # long: would pick PCP 2
        assert len(c.p0.requests) == 4 and c.p1.requests == []
        assert admin.post("/admin/nodes/p0/drain").status_code == 200
        r = c.http().post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_prefill_node"
        assert c.http(None).get("/health").status_code == 503
        r = admin.get("/admin/route", params={"prompt_tokens": 10})
        assert r.status_code == 503 and all(not x["eligible"] for x in r.json()["candidates"])
        assert admin.post("/admin/nodes/p1/undrain").json() == {"node_id": "p1", "draining": False}
        assert admin.post("/admin/nodes/nope/drain").status_code == 404
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert len(c.p1.requests) == 1


def test_admin_route_explains(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        long = admin.get("/admin/route", params={"prompt_tokens": 400}).json()
        short = admin.get("/admin/route", params={"prompt_tokens": 8}).json()
    assert long["prefill"]["node_id"] == "p1" and long["prefill"]["pcp"] == 2
    assert short["prefill"]["node_id"] == "p0"
    assert long["decode"]["node_id"] == "d0" and "running" in long["decode"]["reason"]
    assert {x["node_id"] for x in long["candidates"]} == {"p0", "p1"}
    assert "effective PCP" in long["prefill"]["reason"]


def test_admin_route_says_why_no_node_is_eligible(c: Cluster) -> None:
    with c.http(ADMIN_KEY) as admin:
        r = admin.get("/admin/route", params={"prompt_tokens": MAX_MODEL_LEN + 100})
    assert r.status_code == 503
    message = r.json()["error"]["message"]  # what pdctl route prints: every candidate's reason
    assert all(f"{x['node_id']} rank {x['dp_rank']}: {x['reason']}" in message for x in r.json()["candidates"])
    assert str(MAX_MODEL_LEN) in message, message


def test_pdctl_admin_client_understands_the_admin_api(c: Cluster) -> None:
    from pdctl.admin_client import AdminClient

    admin = AdminClient(c.url, ADMIN_KEY)
    try:
        nodes = {n.state.info.node_id: n for n in admin.nodes()}
        assert set(nodes) == {"p0", "p1", "d0"} and nodes["p1"].state.info.pcp == 2
        route = admin.route(400)
        assert route.prefill.node_id == "p1" and route.decode.node_id == "d0" and len(route.candidates) == 2
        assert admin.set_draining("p1", True) is True
        assert admin.route(400).prefill.node_id == "p0"
        assert admin.set_draining("p1", False) is False
    finally:
        admin.close()


def test_keys_are_enforced(c: Cluster) -> None:
    for key in (None, "wrong"):
        with c.http(key) as h:
            r = h.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert h.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{c.url}/v1", api_key="bad", max_retries=0).models.list()
    with c.http(API_KEY) as h:  # the API key is not the admin key
        assert h.get("/admin/nodes").status_code == 401
        assert h.post("/admin/nodes/p0/drain").status_code == 401
    assert not c.source.snapshot()[0].draining
    with c.http(None) as h:  # health and metrics are open
        assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200


def test_metrics_series(c: Cluster) -> None:
    client = c.client()
    client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    list(client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True))
    with c.http(None) as h:
        h.post("/v1/completions", json={})
        # the stream's cleanup may finish just after its last byte reached the client
        assert wait_until(lambda: "pdcluster_proxy_inflight_requests 0.0" in h.get("/metrics").text)
        text = h.get("/metrics").text
    for series in ("pdcluster_proxy_requests_total", "pdcluster_proxy_time_to_first_token_seconds_bucket",
                   "pdcluster_proxy_inter_token_latency_seconds_bucket", "pdcluster_proxy_kv_transfer_seconds_bucket",
                   "pdcluster_proxy_kv_transfer_bytes_total", "pdcluster_proxy_errors_total",
                   "pdcluster_proxy_inflight_requests", "pdcluster_proxy_routing_decisions_total"):
        assert series in text, series
    assert 'endpoint="/v1/completions",status="200"' in text
    assert 'endpoint="/v1/completions",status="401"' in text
    assert 'node_id="d0",role="decode"' in text
