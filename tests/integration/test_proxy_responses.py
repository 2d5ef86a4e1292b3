"""OpenAI's Responses API through the proxy with the official openai client (fake nodes): ``responses.create``
with text, message items and instructions, ``responses.stream`` (events in OpenAI's order, the same text
as the whole answer), usage, max_output_tokens cutting the answer (incomplete), function tool calls read
back as function_call items and their outputs sent back as input items (``test_proxy_tools.py``, whose fake
nodes answer with calls), and the 400s: a previous_response_id (nothing is stored), unsupported items and
tools; a stored response's GET is a 404. vLLM's sampling extensions (``ignore_eos``, ``stop``, ``top_k``, ...), as
benchmark clients send them, reach the nodes."""

from __future__ import annotations

import pytest
from fake_cluster import MODEL, Cluster


def test_create_gives_the_answer_as_a_message_item_with_usage(c: Cluster) -> None:
    r = c.client().responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=64)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == c.text() and [o.type for o in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.output[0].role == "assistant"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = c.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=64)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False and r.instructions == "Be brief."
    assert list(c.d0.requests[-1].prompt_token_ids) == c.tokenizer.apply_chat_template(msgs)  # instructions first


def test_message_items_with_text_parts_equal_plain_text(c: Cluster) -> None:
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}]}]
    c.client().responses.create(model=MODEL, input=items)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert list(c.d0.requests[-1].prompt_token_ids) == c.tokenizer.apply_chat_template(msgs)


def test_max_output_tokens_cuts_the_answer_as_incomplete(c: Cluster) -> None:
    r = c.client().responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == c.text(3) and r.usage.output_tokens == 3


def test_stream_sends_openais_events_in_order_and_the_same_text(c: Cluster) -> None:
    whole = c.client().responses.create(model=MODEL, input="Hello")
    with c.client().responses.stream(model=MODEL, input="Hello") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_vllms_sampling_extensions_reach_the_nodes(c: Cluster) -> None:
    # guidellm 0.8.1's body for a fixed output length: text parts, stop null, ignore_eos past the EOS.
    n = len(c.script.tokens) + 5
    body = {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
            "max_output_tokens": n, "stop": None, "ignore_eos": True}
    with c.http() as h:
        r = h.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == n, r.text
    assert r.json()["status"] == "incomplete"
    extras = {"top_k": 5, "stop": ["world"], "presence_penalty": 0.5, "frequency_penalty": 0.25,
              "repetition_penalty": 1.5, "logit_bias": {"7": 2.0}}
    r = c.client().responses.create(model=MODEL, input="Hello", extra_body=extras)
    sent = c.d0.requests[-1].sampling
    assert (sent.top_k, list(sent.stop), sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty,
            dict(sent.logit_bias), sent.ignore_eos) == (5, ["world"], 0.5, 0.25, 1.5, {7: 2.0}, False)
    assert "world" not in r.output_text and r.status == "completed"


@pytest.mark.parametrize("body,message", [
    ({"input": "x", "previous_response_id": "resp_1"}, "does not store responses"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "not supported"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 0}, None),
    ({"input": "x", "top_k": -2}, None),  # vLLM's extensions are checked as chat's
    ({}, None),
])
def test_bad_requests_are_400s(c: Cluster, body: dict, message: str | None) -> None:
    with c.http() as h:
        r = h.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    if message is not None:
        assert message in r.json()["error"]["message"]
    with c.http() as h:
        r = h.get("/v1/responses/resp_1")
    assert r.status_code == 404 and "does not store responses" in r.json()["error"]["message"]
