"""A decode leg that fails before its first event moves to another decode rank, once.

One proxy and fake nodes (one prefill node, two decode nodes): a decode node that is full
(RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) before it sends anything costs the client nothing
while another decode rank can take the request; the prefill node's KV is released either way.
``d1`` publishes 5 running requests, so the router prefers ``d0`` until ``d0`` refuses this request
(even counting the request on ``d0``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
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
from cluster.nodes import ReplicaLoad
from engine.tokenizer import Tokenizer
from proxy.routing.discovery import StaticNodeSource

MODEL = "tiny-test"
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 6}


@dataclass
class Nodes:
    url: str
    text: str  # the scripted completion of BODY
    p0: FakePrefill
    d0: FakeDecode
    d1: FakeDecode
    app: object


@pytest.fixture(scope="module")
def nodes(tiny_model: Path) -> Iterator[Nodes]:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Moved decode legs still answer in full.", add_special_tokens=False),
                    tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p0, d0, d1 = FakePrefill("p0", script), FakeDecode("d0", script), FakeDecode("d1", script)
        source = StaticNodeSource([
            node_state("p0", "prefill", fakes.serve(p0), model=MODEL, max_model_len=512),
            node_state("d0", "decode", fakes.serve(d0), model=MODEL, max_model_len=512),
            node_state("d1", "decode", fakes.serve(d1), model=MODEL, max_model_len=512,
                       replicas=(ReplicaLoad(dp_rank=0, running=5, free_blocks=1000),)),
        ])
        config = ProxyConfig(model=str(tiny_model), served_model_name=MODEL, prefill_timeout_s=2.0,
                             token_timeout_s=2.0)
        with running_proxy(config, tok, source) as (url, app):
            yield Nodes(url, tok.decode([script.token_at(i) for i in range(6)]), p0, d0, d1, app)
    finally:
        fakes.stop()


@pytest.fixture
def n(nodes: Nodes) -> Iterator[Nodes]:
    with settled(nodes.app, [nodes.p0], [nodes.d0, nodes.d1]):
        yield nodes


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
def test_a_refused_decode_leg_moves_to_the_other_decode_node(n: Nodes, code: grpc.StatusCode) -> None:
    n.d0.refuse, n.d0.refusals = code, [1]
    r = httpx.post(f"{n.url}/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == n.text
    assert len(n.d0.requests) == 1 and n.d0.finished == []  # refused
    assert len(n.d1.requests) == 1 and len(n.d1.finished) == 1
    assert n.d0.requests[0].request_id == n.d1.requests[0].request_id
    # A full node stays routable for other requests; an unreachable one is avoided at once.
    healthy = {s.info.node_id for s in n.app.state.proxy.view.snapshot() if s.healthy}
    assert ("d0" in healthy) == (code == grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_when_every_decode_node_is_full_the_client_gets_503_and_the_kv_is_freed(n: Nodes) -> None:
    for d in (n.d0, n.d1):
        d.refuse, d.refusals = grpc.StatusCode.RESOURCE_EXHAUSTED, [5]
    r = httpx.post(f"{n.url}/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
    assert len(n.d0.requests) + len(n.d1.requests) == 2  # the first choice and one move, no more
    rid = n.p0.requests[0].request_id
    assert wait_until(lambda: rid in n.p0.aborts)
