"""Tool calls through the proxy with the official openai client: fake nodes answer in DeepSeek's format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, node_state, running_proxy

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.api.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, forced_prefix
from proxy.routing.discovery import StaticNodeSource

MODEL = "tiny-tools"
ANSWER = (f"Let me look.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
          f'{{"city": "Paris"}}\n```{CALL_END}{CALL_BEGIN}function{SEP}get_time\n```json\n{{"tz": "CET"}}\n```'
          f"{CALL_END}{CALLS_END}")
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} of a place",
                                            "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@pytest.fixture(scope="module")
def proxy(tiny_model: Path) -> Iterator[tuple[openai.OpenAI, FakePrefill, Tokenizer]]:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode(ANSWER, add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p0, d0 = FakePrefill("p0", script), FakeDecode("d0", script)
        source = StaticNodeSource([node_state("p0", "prefill", fakes.serve(p0), model=MODEL, max_model_len=1024),
                                   node_state("d0", "decode", fakes.serve(d0), model=MODEL, max_model_len=1024)])
        config = ProxyConfig(model=str(tiny_model), served_model_name=MODEL, prefill_timeout_s=2.0, token_timeout_s=2.0)
        with running_proxy(config, tok, source) as (url, _):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10), p0, tok
    finally:
        fakes.stop()


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


WANT = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_tool_calls_in_a_whole_answer(proxy) -> None:
    client, _, _ = proxy
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert _calls(choice.message.tool_calls) == WANT
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_tool_calls_streamed_and_the_next_turn_with_their_results(proxy) -> None:
    client, _, _ = proxy
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400,
                                                 stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert content == "Let me look."
    assert [d.index for d in deltas] == [0, 1]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == WANT
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    # the conversation goes on with the calls and their results (the template renders them)
    turn = ASK + [{"role": "assistant", "content": "Let me look.",
                   "tool_calls": [{"id": d.id, "type": "function",
                                   "function": {"name": d.function.name, "arguments": d.function.arguments}}
                                  for d in deltas]},
                  {"role": "tool", "tool_call_id": deltas[0].id, "content": "18 C"},
                  {"role": "tool", "tool_call_id": deltas[1].id, "content": "14:00"}]
    assert client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=5).choices


def test_tool_choice_none_leaves_the_text_and_a_named_choice_starts_the_answer_inside_its_call(proxy) -> None:
    client, p0, tok = proxy
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=400)
    assert r.choices[0].message.content == ANSWER and not r.choices[0].message.tool_calls
    named = {"type": "function", "function": {"name": "get_time"}}
    client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=4)
    prefix = tok.encode(forced_prefix(named), add_special_tokens=False)
    assert list(p0.requests[-1].token_ids[-len(prefix):]) == prefix


@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS + TOOLS[:1]},
    {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}},
])
def test_bad_tool_requests_are_400s(proxy, body) -> None:
    client, _, _ = proxy
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **body)


RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n} of a place",
                    "parameters": {"type": "object", "properties": {}}} for n in ("get_weather", "get_time")]


def test_responses_api_function_calls_come_back_as_items_and_their_outputs_go_in_as_items(proxy) -> None:
    client, p0, tok = proxy
    r = client.responses.create(model="tiny-tools", input=ASK[0]["content"], tools=RESPONSES_TOOLS)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "Let me look."
    assert [(o.name, json.loads(o.arguments)) for o in calls] == WANT and all(o.call_id for o in calls)
    with client.responses.stream(model="tiny-tools", input=ASK[0]["content"], tools=RESPONSES_TOOLS) as stream:
        final = stream.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == WANT
    # the next turn: the calls and their outputs as input items, rendered as chat's assistant and tool messages
    turn = [{"role": "user", "content": ASK[0]["content"]},
            *({"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments} for o in calls),
            *({"type": "function_call_output", "call_id": o.call_id, "output": "sunny"} for o in calls)]
    client.responses.create(model="tiny-tools", input=turn, tools=RESPONSES_TOOLS)
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in RESPONSES_TOOLS]
    msgs = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}} for o in calls]},
        *({"role": "tool", "tool_call_id": o.call_id, "content": "sunny"} for o in calls)]
    assert list(p0.requests[-1].token_ids) == tok.apply_chat_template(msgs, tools=chat_tools)
