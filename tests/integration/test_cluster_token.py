"""The cluster token on gRPC (``cluster.auth``): a node with one refuses every call that lacks it
(UNAUTHENTICATED), but not health checks; the proxy's and the decode side's calls carry it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, node_state, running_proxy

from cluster.auth import METADATA_KEY, TokenCheck, call_metadata
from cluster.config import ProxyConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from engine.tokenizer import Tokenizer
from node_runtime.confirm import PrefillConfirmer
from proxy.routing.discovery import StaticNodeSource

TOKEN = "s3cret-token"


@dataclass
class Guarded:
    """A fake prefill and a fake decode node behind the token check."""

    prefill: FakePrefill
    decode: FakeDecode
    addresses: dict[str, str]


@pytest.fixture
def guarded(tiny_model: Path) -> Iterator[Guarded]:
    tok = Tokenizer(tiny_model)
    script = Script(tok.encode("Hello from the fake nodes.", add_special_tokens=False), tok.eos_token_id)
    fakes = FakeNodes()
    try:
        p, d = FakePrefill("p0", script), FakeDecode("d0", script)
        check = [TokenCheck(TOKEN)]
        yield Guarded(p, d, {"prefill": fakes.serve(p, check), "decode": fakes.serve(d, check)})
    finally:
        fakes.stop()


def test_calls_without_the_token_are_refused_but_health_checks_are_not(guarded: Guarded) -> None:
    with grpc.insecure_channel(guarded.addresses["prefill"]) as ch:
        stub = pb_grpc.PrefillServiceStub(ch)
        for metadata in (None, ((METADATA_KEY, "wrong"),), ((METADATA_KEY, TOKEN + "x"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Abort(pb.AbortRequest(request_id="r"), timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert guarded.prefill.aborts == []  # nothing reached the servicer
        assert stub.Abort(pb.AbortRequest(request_id="r"), timeout=5, metadata=call_metadata(TOKEN)).found is False
        assert guarded.prefill.aborts == ["r"]
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(guarded.addresses["decode"]) as ch:  # a server stream is refused as well
        call = pb_grpc.DecodeServiceStub(ch).Decode(pb.DecodeRequest(request_id="r"), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert guarded.decode.requests == []


def test_the_proxy_and_the_decode_sides_release_carry_the_token(
        tiny_model: Path, guarded: Guarded, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", TOKEN)
    source = StaticNodeSource([
        node_state("p0", "prefill", guarded.addresses["prefill"], model="tiny", max_model_len=256),
        node_state("d0", "decode", guarded.addresses["decode"], model="tiny", max_model_len=256)])
    config = ProxyConfig(model=str(tiny_model), served_model_name="tiny")
    with running_proxy(config, Tokenizer(tiny_model), source) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 50}, timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello from the fake nodes."
    # The decode node's confirmation after a pull (a blocking Release from its pull threads):
    guarded.prefill.held.add("pulled")
    confirm = PrefillConfirmer()
    try:
        assert confirm(guarded.addresses["prefill"], "pulled") is True and "pulled" in guarded.prefill.released
    finally:
        confirm.close()
