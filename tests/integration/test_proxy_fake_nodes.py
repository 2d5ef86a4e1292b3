"""The proxy end to end against fake prefill/decode gRPC nodes, through the official openai client:
what it answers (completions, chat, streaming, sampling, choices, tokenizing). The fake cluster is
``fake_cluster.py``'s; bad input, node failures and the admin API have modules of their own."""

from __future__ import annotations

import importlib.metadata
import json
import re

import openai
import pytest
from fake_cluster import MAX_MODEL_LEN, MODEL, SCRIPT_TEXT, TINY_VOCAB, Cluster
from proxy_fakes import wait_until

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
        # vLLM's liveness route answers as /health does; HEAD as GET without a body
        assert [h.get("/ping").json(), h.post("/ping").json()] == [r.json()] * 2
        assert h.head("/health").status_code == 200 and h.head("/metrics").status_code == 200
        assert h.get("/version").json() == {"version": importlib.metadata.version("pdcluster")}
    card = c.client().models.retrieve(MODEL)  # the openai client's models.retrieve
    assert (card.id, card.owned_by, card.model_extra["max_model_len"]) == (MODEL, "pdcluster", MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.client().models.retrieve("other")
