"""The whole cluster through its user interfaces: the official ``openai`` client, ``pdctl``, SSE.

One PCP2 prefill node (sharded KV) and decode nodes DP2 (decode-0) and DP1 (decode-1). Greedy
outputs must equal the engine's colocated PCP1 outputs; no KV block may stay used afterwards.
Tests run in file order: the last one kills a decode node.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import openai
import psutil
import pydantic
import pytest
from e2e_cluster import ADMIN_KEY, Cluster, scrape, wait_all_free

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.tokenizer import Tokenizer
from pdctl.launcher import read_state

MODEL = "tiny"
KW = dict(dtype="float32", device="cpu", max_model_len=1024)


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0, timeout=120)


def colocated(c: Cluster, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], str, list[float]]]:
    with LLM(str(c.model), **KW) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, logprobs=1) for m in max_tokens])
    return [(o.token_ids, o.text, o.logprobs) for o in outs]


def routed(c: Cluster) -> dict[tuple[str, str], float]:
    """The proxy's routing counters: (role, node) -> decisions."""
    out = {}
    for line in httpx.get(f"{c.url}/metrics").text.splitlines():
        if line.startswith("pdcluster_proxy_routing_decisions_total{"):
            labels, value = line[line.index("{") + 1 : line.index("}")], float(line.rsplit(" ", 1)[1])
            d = dict(kv.split("=") for kv in labels.split(","))
            out[(d["role"].strip('"'), d["node_id"].strip('"'))] = value
    return out


def pdctl(c: Cluster, *args: str) -> str:
    env = {**os.environ, "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "pdctl.cli", *args, "--proxy", c.url, "--admin-key", ADMIN_KEY],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    return r.stdout


def test_chat_and_completions_equal_colocated_pcp1(cluster: Cluster) -> None:
    tok = Tokenizer(cluster.model)
    messages = [{"role": "user", "content": "What does a serving cluster do?"}]
    long_ids = [(i * 7 + 3) % 1000 + 2 for i in range(607)]
    chat_ids = tok.apply_chat_template(messages)
    text_ids = tok.encode("Hello there")
    want = colocated(cluster, [chat_ids, long_ids, text_ids], [12, 10, 8])
    oa = client(cluster)

    chat = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want[0][1]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_ids), len(want[0][0]))
    assert chat.usage.total_tokens == len(chat_ids) + len(want[0][0])
    stream = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want[0][1]
    assert chunks[-1].usage.completion_tokens == len(want[0][0])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    comp = oa.completions.create(model=MODEL, prompt=long_ids, max_tokens=10, temperature=0, logprobs=1)
    assert comp.choices[0].text == want[1][1]
    assert comp.usage.prompt_tokens == 607 and comp.usage.completion_tokens == 10
    assert comp.choices[0].logprobs.token_logprobs == pytest.approx(want[1][2], abs=1e-4)
    stream = oa.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == want[2][1]
    assert not any(wait_all_free(cluster).values())


def test_64_concurrent_streams_complete_and_free_every_block(cluster: Cluster) -> None:
    prompts = [[(i * 13 + j * 7) % 1000 + 2 for j in range(5 + (i * 37) % 700)] for i in range(64)]
    max_tokens = [1 + (i * 5) % 24 for i in range(64)]
    want = colocated(cluster, prompts, max_tokens)
    oa = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> tuple[str, int, str | None]:
        stream = await oa.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        text, usage, finish = "", -1, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
        return text, usage, finish

    async def all_() -> list[tuple[str, int, str | None]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await oa.close()

    got = asyncio.run(all_())
    for i, (text, n, finish) in enumerate(got):
        assert (text, n) == (want[i][1], len(want[i][0])), f"request {i} ({len(prompts[i])} tokens)"
        assert finish in ("length", "stop")
    used = wait_all_free(cluster)
    assert not any(used.values()), f"KV blocks still used after the burst: {used}"
    # decode-0 (dp 2, dp_processes on) served its share from two replica processes
    node = next(p for p in read_state(cluster.run_dir).processes if p.name == "decode-0")
    spawned = [c for c in psutil.Process(node.pid).children(recursive=True)
               if "multiprocessing" in " ".join(c.cmdline())]
    assert len(spawned) >= 2, [c.cmdline() for c in spawned]


BAD = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(2, 1100)), "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}),
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(a"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_choice": ["a"], "guided_regex": "a"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "yaml"}}),
    ("/v1/responses", b"{not json"),
    ("/v1/responses", {"model": "nope", "input": "hi"}),
    ("/v1/responses", {"model": MODEL}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 0}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"}),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]}),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": "function"}]}),
]


@pytest.mark.parametrize("path,body", BAD)
def test_bad_input_gets_an_openai_error_and_the_cluster_keeps_serving(cluster: Cluster, path: str, body) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{cluster.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    expected = 404 if isinstance(body, dict) and body.get("model") == "nope" else 400
    assert r.status_code == expected, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    ok = client(cluster).completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_status_and_drain_stop_new_routing_while_in_flight_finish(cluster: Cluster) -> None:
    out = pdctl(cluster, "status")
    for node in ("prefill-0", "decode-0", "decode-1"):
        assert node in out
    assert "1/2/1" in out and "2/1/1" in out  # DP/PCP/PP of the prefill node and of decode-0
    oa = client(cluster)
    pdctl(cluster, "drain", "decode-0")  # everything goes to decode-1 now
    r0 = routed(cluster)
    # A long stream starts on decode-1, then decode-1 is drained while it runs.
    stream = oa.completions.create(model=MODEL, prompt=[5] * 50, max_tokens=150, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    it = iter(stream)
    first = next(it)
    pdctl(cluster, "undrain", "decode-0")
    pdctl(cluster, "drain", "decode-1")
    lines = {ln.split()[0]: ln for ln in pdctl(cluster, "nodes").splitlines() if ln.strip()}
    assert "draining" in lines["decode-1"] and "draining" not in lines["decode-0"]
    for _ in range(4):
        assert oa.completions.create(model=MODEL, prompt="short", max_tokens=2, temperature=0).usage
    rest = list(it)
    assert rest[-1].choices[0].finish_reason == "length"  # the drained node finished what it had
    assert len(first.choices[0].text + "".join(c.choices[0].text for c in rest)) > 0
    r1 = routed(cluster)
    got = {k: r1.get(k, 0) - r0.get(k, 0) for k in r1}
    assert got.get(("decode", "decode-1"), 0) == 1 and got.get(("decode", "decode-0"), 0) == 4, got
    pdctl(cluster, "undrain", "decode-1")


def test_a_client_that_disconnects_mid_stream_frees_the_kv_everywhere(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": [9] * 300, "max_tokens": 700, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    assert seen == 3
    used = wait_all_free(cluster)
    assert not any(used.values()), f"blocks still used after the client left: {used}"
    m = httpx.get(f"{cluster.url}/metrics").text
    assert "pdcluster_proxy_inflight_requests 0.0" in m


def prefix_hits(c: Cluster, node_id: str) -> int:
    return sum(r.get("prefix_hit_blocks", 0) for r in c.nodes()[node_id]["replicas"])


def test_a_repeated_prompt_hits_the_prefill_nodes_prefix_cache_with_the_same_output(cluster: Cluster) -> None:
    """The prefill node runs with prefix caching (its PCP2 sharded cache); the output is unchanged."""
    prompt = [(i * 29 + 11) % 1000 + 2 for i in range(300)]  # 18 full blocks of 16, and 12 tokens
    want = colocated(cluster, [prompt], [6])[0][1]  # its text
    before = prefix_hits(cluster, "prefill-0")
    for _ in range(2):
        r = client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert r.choices[0].text == want
    # the second request found the first one's 18 full blocks (heartbeats publish the counters)
    deadline = time.monotonic() + 5
    while prefix_hits(cluster, "prefill-0") - before < 18 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefix_hits(cluster, "prefill-0") - before >= 18
    assert not any(wait_all_free(cluster).values())


def metric(c: Cluster, name: str) -> float:
    """One series of the proxy's /metrics (0 before its first sample)."""
    for line in httpx.get(f"{c.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_conversations_next_turn_pulls_only_its_new_blocks_into_the_same_decode_rank(cluster: Cluster) -> None:
    """decode-0 caches prefixes: the proxy sends turn 2 where turn 1 decoded, which pulls only the new
    blocks; the answers equal one colocated engine's."""
    turn1 = [(i * 31 + 7) % 1000 + 2 for i in range(300)]  # 18 full blocks of 16, and 12 tokens
    user2 = [(i * 13 + 3) % 1000 + 2 for i in range(100)]
    pdctl(cluster, "drain", "decode-1")  # it does not cache prefixes: keep the conversation on decode-0
    try:
        moved, cached, answers, prompt = [], [], [], turn1
        for _ in range(2):
            before = (metric(cluster, "pdcluster_proxy_kv_transfer_bytes_total"),
                      metric(cluster, 'pdcluster_proxy_prefix_cached_tokens_total{leg="decode"}'))
            r = client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                                   extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
            moved.append(metric(cluster, "pdcluster_proxy_kv_transfer_bytes_total") - before[0])
            cached.append(metric(cluster, 'pdcluster_proxy_prefix_cached_tokens_total{leg="decode"}') - before[1])
            answers.append(ids)
            prompt = turn1 + ids + user2  # the next turn: history, then the new user turn
    finally:
        pdctl(cluster, "undrain", "decode-1")
    with LLM(str(cluster.model), **KW) as llm:
        want = llm.generate([turn1, turn1 + answers[0] + user2],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert answers == [w.token_ids for w in want]
    # turn 1's prompt and all but its last answer token (307 tokens: 19 full blocks) stayed cached;
    # turn 2 (408 tokens, 26 blocks) pulls 7 blocks where turn 1 pulled 19
    assert cached == [0, 19 * 16]
    assert moved[1] == moved[0] * 7 / 19
    assert not any(wait_all_free(cluster).values())
    # the nodes' caches publish what they stored with their heartbeats; the proxy follows them
    deadline = time.monotonic() + 5
    while metric(cluster, "pdcluster_proxy_kv_event_messages_total") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(cluster, "pdcluster_proxy_kv_event_messages_total") > 0


def test_penalties_and_logit_bias_through_the_cluster_equal_colocated(cluster: Cluster) -> None:
    """The first token comes from the prefill node, the rest from the decode node: both apply them."""
    prompt = [(i * 17 + 9) % 1000 + 2 for i in range(40)]
    params = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5, logit_bias={11: 20.0})
    r = client(cluster).completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, presence_penalty=0.8,
        frequency_penalty=0.4, logit_bias={"11": 20},
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    with LLM(str(cluster.model), **KW) as llm:
        want, plain = llm.generate([prompt, prompt], [
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **params),  # type: ignore[arg-type]
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)])
    assert ids == want.token_ids != plain.token_ids


def test_n_samples_share_the_prompts_kv_and_equal_seeded_single_requests(cluster: Cluster) -> None:
    """n=3 with a seed: sample i equals a single request with seed + i; the prompt's full blocks are
    prefilled and pulled once (the other samples find them in both nodes' prefix caches)."""
    prompt = [(i * 23 + 4) % 1000 + 2 for i in range(100)]  # 6 full blocks of 16, and 4 tokens
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, logprobs=0)
    ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    pdctl(cluster, "drain", "decode-1")  # decode-1 does not cache prefixes
    try:
        hits = [metric(cluster, f'pdcluster_proxy_prefix_cached_tokens_total{{leg="{leg}"}}')
                for leg in ("prefill", "decode")]
        r = client(cluster).completions.create(n=3, seed=5, extra_body=ids, **kw)
        hits = [metric(cluster, f'pdcluster_proxy_prefix_cached_tokens_total{{leg="{leg}"}}') - before
                for leg, before in zip(("prefill", "decode"), hits)]
        singles = [client(cluster).completions.create(seed=5 + i, extra_body=ids, **kw) for i in range(3)]
    finally:
        pdctl(cluster, "undrain", "decode-1")
    got = [[t for t in ch.logprobs.tokens] for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert got == [s.choices[0].logprobs.tokens for s in singles]
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 18
    assert hits[0] >= 2 * 96 and hits[1] >= 2 * 96, hits  # samples 1 and 2 found the 6 full blocks
    assert not any(wait_all_free(cluster).values())


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_the_prompt_and_its_logprobs_then_the_answer(cluster: Cluster, stream: bool) -> None:
    """As lm-eval's loglikelihood requests use it: the prompt's logprobs come from the prefill node."""
    prompt = "A serving cluster keeps prompts"
    ids = Tokenizer(cluster.model).encode(prompt)
    with LLM(str(cluster.model), **KW) as llm:
        want = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, prompt_logprobs=1))[0]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    if stream:
        chunks = [ch.choices[0] for ch in client(cluster).completions.create(stream=True, **kw) if ch.choices]
        text = "".join(ch.text for ch in chunks)
        token_logprobs = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
    else:
        choice = client(cluster).completions.create(**kw).choices[0]
        text, token_logprobs = choice.text, choice.logprobs.token_logprobs
    assert text == prompt + want.text
    assert len(token_logprobs) == len(ids) + 4 and token_logprobs[0] is None
    assert token_logprobs[1:len(ids)] == pytest.approx(want.prompt_logprobs[1:], abs=1e-3)
    assert token_logprobs[len(ids):] == pytest.approx(want.logprobs, abs=1e-3)


class Shirt(pydantic.BaseModel):
    """What the openai client's ``parse`` turns into a strict JSON schema (bounded: see the unit corpus)."""

    color: Literal["red", "green", "blue"]
    size: int = pydantic.Field(ge=1, le=5)
    name: str = pydantic.Field(max_length=10)
    tags: list[Literal["new", "sale"]] = pydantic.Field(max_length=2)


def structured_colocated(c: Cluster, ids: list[int], spec: StructuredOutputsParams, max_tokens: int) -> str:
    with LLM(str(c.model), **KW) as llm:
        return llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  structured_outputs=spec))[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_through_the_cluster_validates_and_equals_colocated(cluster: Cluster, stream: bool) -> None:
    """The openai client's ``parse`` (response_format json_schema, strict) and a stream of the same: the
    prefill node masks the first token, the decode node replays it and masks the rest."""
    messages = [{"role": "user", "content": "Describe a shirt as JSON."}]
    ids = Tokenizer(cluster.model).apply_chat_template(messages)
    schema = openai.lib._pydantic.to_strict_json_schema(Shirt)
    want = structured_colocated(cluster, ids, StructuredOutputsParams(json=schema), 200)
    if stream:
        fmt = {"type": "json_schema", "json_schema": {"name": "Shirt", "schema": schema, "strict": True}}
        chunks = client(cluster).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=200,
                                                         response_format=fmt, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        shirt = Shirt.model_validate_json(text)
    else:
        r = client(cluster).chat.completions.parse(model=MODEL, messages=messages, temperature=0, max_tokens=200,
                                                   response_format=Shirt)
        text, shirt = r.choices[0].message.content, r.choices[0].message.parsed
        assert r.choices[0].finish_reason == "stop"
    assert isinstance(shirt, Shirt) and text == want


def test_guided_choice_regex_and_json_object_through_the_cluster(cluster: Cluster) -> None:
    """vLLM's guided_* fields and structured_outputs object, on completions (n=2 samples each follow it)."""
    prompt = "The answer is"
    choices, regex, array = ["yes", "no", "it depends"], "[0-9]{2}-[a-z]{3}", {"type": "array", "maxItems": 3,
                                                                                "items": {"type": "boolean"}}
    cases = [({"guided_choice": choices}, StructuredOutputsParams(choice=choices)),
             ({"guided_regex": regex}, StructuredOutputsParams(regex=regex)),
             ({"structured_outputs": {"json": array}}, StructuredOutputsParams(json=array))]
    ids = Tokenizer(cluster.model).encode(prompt)
    with LLM(str(cluster.model), **KW) as llm:
        want = [o.text for o in llm.generate([ids] * len(cases), [
            SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec) for _, spec in cases])]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40)
    for (body, _), text in zip(cases, want):
        assert client(cluster).completions.create(temperature=0, extra_body=body, **kw).choices[0].text == text
        sampled = client(cluster).completions.create(temperature=1.0, seed=3, n=2, extra_body=body, **kw)
        follows = {"guided_choice": lambda t: t in choices, "guided_regex": lambda t: re.fullmatch(regex, t),
                   "structured_outputs": lambda t: isinstance(json.loads(t), list)}[next(iter(body))]
        assert all(ch.finish_reason == "stop" and follows(ch.text) for ch in sampled.choices), sampled.choices
    r = client(cluster).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    assert not any(wait_all_free(cluster).values())


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]


@pytest.mark.parametrize("choice", ["named", "required", "required-one"])
def test_a_forced_tool_call_always_parses_and_holds_its_schema(cluster: Cluster, choice: str) -> None:
    """tool_choice naming a function, or "required" (with and without parallel calls), on the random tiny
    model sampled with 10 seeds: the arguments are JSON that validates against the tool's schema, as the
    grammar the proxy sends with the request holds them to; streamed (3 seeds), the same calls arrive."""
    import jsonschema

    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    extra = {"parallel_tool_calls": False} if choice == "required-one" else {}
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris, and the time?"}], tools=TOOLS,
              tool_choice=tool_choice, temperature=1.0, max_tokens=300, **extra)
    for seed in range(10):
        r = client(cluster).chat.completions.create(seed=seed, **kw)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice == "named":
            assert [c.function.name for c in calls] == ["get_weather"]
        if choice == "required-one":
            assert len(calls) == 1
        if seed < 3:
            streamed = client(cluster).chat.completions.create(seed=seed, stream=True, **kw)
            deltas = [c for ch in streamed if ch.choices for c in ch.choices[0].delta.tool_calls or []]
            assert [(d.function.name, d.function.arguments) for d in deltas] == [
                (c.function.name, c.function.arguments) for c in calls]
    assert not any(wait_all_free(cluster).values())


def test_the_responses_api_through_the_cluster(cluster: Cluster) -> None:
    """The openai client's responses.create and responses.stream on the real engine: greedy text equal to the
    chat completion of the same messages, streamed equal to whole; text.format json_schema and a forced
    function call validate against their schemas."""
    import jsonschema

    oa = client(cluster)
    assert oa.models.retrieve(MODEL).id == MODEL
    kw = dict(model=MODEL, instructions="Be brief.", input="What does a serving cluster do?", temperature=0,
              max_output_tokens=24)
    chat = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a serving cluster do?"}])
    whole = oa.responses.create(**kw)
    assert whole.output_text == chat.choices[0].message.content and whole.usage.output_tokens == 24
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    with oa.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and kinds[0] == "response.created"
    assert kinds[-1] == "response.completed" and final.status == "incomplete"
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    r = oa.responses.create(model=MODEL, input="Weather as JSON", text=fmt, temperature=1.0, max_output_tokens=200,
                            extra_body={"seed": 1})
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    r = oa.responses.create(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required",
                            temperature=1.0, max_output_tokens=300, extra_body={"seed": 2})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), {"get_weather": WEATHER, "get_time": CLOCK}[call.name])
    assert not any(wait_all_free(cluster).values())


def test_pdctl_route_explains_the_expected_prefix_hit_of_a_prompts_text(cluster: Cluster) -> None:
    text = "A serving cluster keeps the prompt's blocks for the next request. " * 12
    client(cluster).completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    out = pdctl(cluster, "route", "--prompt", text, "--max-tokens", "4")
    n = len(Tokenizer(cluster.model).encode(text))
    assert f"prompt: {n} tokens, " in out
    hit = int(out.split(f"prompt: {n} tokens, ", 1)[1].split(" ", 1)[0])
    assert hit >= (n - 1) // 16 * 16 - 16 > 0, out  # the prefill replica that had it holds its full blocks
    assert "expected in its prefix cache" in out


def node_pages(c: Cluster) -> dict[str, str]:
    """Each node's /metrics URL, from where it says it serves them (the registry, through the admin API)."""
    return {node_id: f"http://{n['metrics_address']}/metrics" for node_id, n in c.nodes().items()}


def test_every_nodes_metrics_in_vllms_names_exist_and_move(cluster: Cluster) -> None:
    """Every node serves /metrics at the address it publishes: requests running go up while streams run and
    back to 0, KV usage rises and falls, the request-level histograms and token counters count the requests,
    a repeated prompt counts prefix cache hits; the proxy's vLLM-named series count them too. Every metric
    the Grafana dashboard (deploy/grafana/pdcluster.json) queries is one of these pages'."""
    pages = node_pages(cluster)
    assert set(pages) == {"prefill-0", "decode-0", "decode-1"}
    decodes = [u for n, u in pages.items() if n.startswith("decode")]
    before = {n: scrape(u) for n, u in pages.items()}
    proxy_before = scrape(f"{cluster.url}/metrics")
    prompts = [f"Request {i}: tell me about serving clusters and their caches." for i in range(6)]

    def one(text: str) -> int:
        r = client(cluster).completions.create(model=MODEL, prompt=text, max_tokens=64, temperature=0,
                                               extra_body={"ignore_eos": True})
        return r.usage.prompt_tokens

    peak_running, peak_usage = 0.0, 0.0
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        while not all(f.done() for f in futures):
            now = [scrape(u) for u in decodes]
            peak_running = max(peak_running, sum(p.total("vllm:num_requests_running") for p in now))
            peak_usage = max(peak_usage, *(max((v for (n, _), v in p.samples.items()
                                               if n == "vllm:kv_cache_usage_perc"), default=0.0) for p in now))
            time.sleep(0.05)
        prompt_tokens = sum(f.result() for f in futures)
    assert peak_running > 0 and peak_usage > 0, (peak_running, peak_usage)
    deadline = time.monotonic() + 10
    while True:
        after = {n: scrape(u) for n, u in pages.items()}
        idle = all(p.total("vllm:num_requests_running") == 0 and p.total("vllm:kv_cache_usage_perc") == 0
                   for n, p in after.items() if n.startswith("decode"))
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, {n: (p.total("vllm:num_requests_running"), p.total("vllm:kv_cache_usage_perc"))
                  for n, p in after.items()}

    def moved(name: str, role: str) -> float:
        return sum(after[n].total(name) - before[n].total(name) for n in pages if n.startswith(role))

    assert moved("vllm:prompt_tokens_total", "prefill") == prompt_tokens
    assert moved("vllm:time_to_first_token_seconds_count", "prefill") == len(prompts)
    assert moved("vllm:request_queue_time_seconds_count", "prefill") == len(prompts)
    assert moved("vllm:generation_tokens_total", "decode") == len(prompts) * 63  # the first token is prefill's
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert moved(name, "decode") == len(prompts), name
    assert moved("vllm:inter_token_latency_seconds_count", "decode") == len(prompts) * 62
    assert moved("pdcluster_kv_transfers_total", "decode") == len(prompts)
    assert moved("pdcluster_kv_transfer_bytes_total", "decode") > 0
    proxy = scrape(f"{cluster.url}/metrics")
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert proxy.total(name, role="proxy") - proxy_before.total(name, role="proxy") == len(prompts), name

    # a repeated prompt: its second prefill finds the first one's 18 full blocks in the prefill node's cache
    prompt = [(i * 31 + 5) % 1000 + 2 for i in range(300)]
    hits = scrape(pages["prefill-0"]).total("vllm:prefix_cache_hits_total")
    for _ in range(2):
        client(cluster).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert scrape(pages["prefill-0"]).total("vllm:prefix_cache_hits_total") - hits >= 18 * 16

    declared = set().union(*(p.declared for p in after.values()), proxy.declared)
    for name in ("vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "pdcluster_kv_leases_held", "pdcluster_node_info"):
        assert name in declared, name
    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/pdcluster.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel["targets"]
               for m in re.findall(r"\b(?:vllm:|pdcluster_|process_)[a-z0-9_:]+", t["expr"])}
    assert queried and queried <= declared, queried - declared
    assert not any(wait_all_free(cluster).values())


def test_a_killed_decode_node_ends_its_stream_with_an_error_and_frees_prefill_blocks(cluster: Cluster) -> None:
    pdctl(cluster, "drain", "decode-0")  # the stream must land on decode-1
    body = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 800, "temperature": 0, "stream": True,
            "ignore_eos": True}
    victim = next(p for p in read_state(cluster.run_dir).processes if p.name == "decode-1")
    events: list[dict] = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.killpg(victim.pid, signal.SIGKILL)
                    pdctl(cluster, "undrain", "decode-0")
        t_end = time.monotonic()
    assert "error" in events[-1], f"the stream ended without an error event: {events[-1]}"
    assert all("error" not in e for e in events[:-1])
    assert time.monotonic() - t_end < 5
    # The prefill node's blocks are freed (the proxy aborts there; the lease would expire anyway).
    used = wait_all_free(cluster)
    assert used.get("prefill-0") == 0, used
    # New requests go to the surviving decode node.
    for _ in range(3):
        r = client(cluster).completions.create(model=MODEL, prompt="again", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
