"""``python -m proxy`` through a registry outage and with a failing node: it serves on its last view of
Redis (``/health`` and ``/admin/nodes`` say the view is stale, ``/metrics`` has registry_up 0), node
health then comes from its own gRPC health probes, the nodes re-register when Redis comes back; and a
node that refuses a connection opens its circuit breaker until a probe and a good call close it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc  # noqa: I001  (after the fakes: the same module objects)
import httpx
import pytest
from grpc_health.v1 import health_pb2
from proxy_fakes import FakeDecode, FakeNodes, FakePrefill, Script, heartbeating, node_state, wait_until
from test_proxy_main import ADMIN_KEY, MODEL, running_proxy

from cluster.config import RegistryConfig
from cluster.net import free_port
from cluster.registry import Registry
from engine.tokenizer import Tokenizer
from pdctl.redis_server import start_redis


class Cluster:
    """Redis on a fixed port (so it can come back on it), a fake prefill and two fake decode nodes
    heartbeating into it as real nodes do (through an outage: errors are retried)."""

    def __init__(self, tiny_model: Path) -> None:
        tok = Tokenizer(tiny_model)
        self.script = Script(tok.encode("Hello from the fake nodes.", add_special_tokens=False), tok.eos_token_id)
        self.port = free_port()
        self.redis = start_redis(port=self.port)
        self.url = self.redis.url
        self.fakes = FakeNodes()
        self.p0 = FakePrefill("p0", self.script)
        self.d0, self.d1 = FakeDecode("d0", self.script), FakeDecode("d1", self.script)
        self.states = [node_state("p0", "prefill", self.fakes.serve(self.p0), model=MODEL, max_model_len=256),
                       node_state("d0", "decode", self.fakes.serve(self.d0), model=MODEL, max_model_len=256),
                       node_state("d1", "decode", self.fakes.serve(self.d1), model=MODEL, max_model_len=256)]
        self.registry = Registry(RegistryConfig(url=self.url, cluster="proxytest", ttl_s=1.0, heartbeat_s=0.2))
        self._beats = ExitStack()
        self._beats.enter_context(heartbeating(self.registry, self.states, every_s=0.2))

    def set_serving(self, fake: FakeDecode, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.fakes.call(fake.health.set("", status))

    def close(self) -> None:
        self._beats.close()
        self.registry.close()
        self.redis.stop()
        self.fakes.stop()


@pytest.fixture
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    c = Cluster(tiny_model)
    try:
        yield c
    finally:
        c.close()


def complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 50}, timeout=10)


def nodes(url: str) -> dict:
    return httpx.get(f"{url}/admin/nodes", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).json()


def circuit(url: str, node_id: str) -> str:
    return next(n["circuit"] for n in nodes(url)["nodes"] if n["node_id"] == node_id)


def metric(url: str, name: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=5).text
    return float(next(line.split()[-1] for line in page.splitlines() if line.startswith(name + " ")))


def test_a_refused_connection_opens_the_breaker_until_a_probe_and_a_good_call_close_it(
        tiny_model: Path, cluster: Cluster) -> None:
    with running_proxy(tiny_model, cluster.url, "--health-probe-s", "0.5") as (url, _):
        once = [1]  # shared: whichever decode node is chosen first refuses, once
        cluster.d1.refuse, cluster.d1.refusals = grpc.StatusCode.UNAVAILABLE, once
        cluster.d0.refuse, cluster.d0.refusals = grpc.StatusCode.UNAVAILABLE, once
        # The first decode rank refuses: the leg moves to the other ...
        assert complete(url).status_code == 200
        refused = next(n for n in ("d0", "d1") if circuit(url, n) == "open")  # ... and its breaker opened
        states = {n["node_id"]: n for n in nodes(url)["nodes"]}
        assert not states[refused]["healthy"]
        # Its health service says SERVING: the next probe half-opens it; a good call then closes it.
        assert wait_until(lambda: circuit(url, refused) != "open", 5)
        fake = cluster.d0 if refused == "d0" else cluster.d1
        served = len(fake.finished)
        for _ in range(10):
            assert complete(url).status_code == 200
            if len(fake.finished) > served:
                break
        assert len(fake.finished) > served and circuit(url, refused) == "closed"


def test_the_proxy_serves_through_a_registry_outage_on_its_own_health_probes(
        tiny_model: Path, cluster: Cluster) -> None:
    with running_proxy(tiny_model, cluster.url, "--health-probe-s", "0.2") as (url, _):
        assert complete(url).status_code == 200
        assert metric(url, "pdcluster_proxy_registry_up") == 1.0
        cluster.redis.stop()
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json().get("registry") == "stale", 5)
        assert not wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code != 200, 2.0)  # past the TTL
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["decode"] == 2 and "registry_error" in health
        assert all(complete(url).status_code == 200 for _ in range(4))  # served on the last view
        assert metric(url, "pdcluster_proxy_registry_up") == 0.0
        assert nodes(url)["registry"] == "stale"

        # Without heartbeats, a node's health comes from the proxy's probes: d0 stops serving.
        cluster.set_serving(cluster.d0, False)
        assert wait_until(lambda: circuit(url, "d0") == "open", 5)
        before = len(cluster.d0.requests)
        assert all(complete(url).status_code == 200 for _ in range(4))
        assert len(cluster.d0.requests) == before  # every one went to d1

        # Redis comes back (empty, on the same port): the nodes re-register, the view is fresh again.
        cluster.redis = start_redis(port=cluster.port)
        cluster.set_serving(cluster.d0, True)
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json().get("registry") == "ok", 10)
        assert wait_until(lambda: circuit(url, "d0") != "open", 5)
        assert wait_until(lambda: metric(url, "pdcluster_proxy_registry_up") == 1.0, 2)
        assert all(complete(url).status_code == 200 for _ in range(4))
