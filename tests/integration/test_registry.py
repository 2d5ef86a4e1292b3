"""The Redis registry and the proxy's cached view against a real redis-server."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import redis

from cluster.config import RegistryConfig
from cluster.net import free_port
from cluster.nodes import NodeFailure, NodeInfo, NodeState, ReplicaLoad
from cluster.registry import FAILURE_TTL_S, Registry, RegistryError, RegistryView
from pdctl.redis_server import RedisServer, start_redis

_clusters = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


@pytest.fixture
def config(server: RedisServer) -> RegistryConfig:
    # A cluster name per test: the tests share one server the way clusters would.
    return RegistryConfig(url=server.url, cluster=f"t{next(_clusters)}", ttl_s=1.0, heartbeat_s=0.25)


@pytest.fixture
def registry(config: RegistryConfig) -> Iterator[Registry]:
    r = Registry(config)
    yield r
    r.close()


def info(node_id: str, role: str = "prefill") -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, address="127.0.0.1:1", model="tiny", max_model_len=2048, dp=2,
                    pcp=2, pp=1, kv_layout="sharded", block_size=16, num_blocks=64, started_at=time.time())


LOADS = (ReplicaLoad(0, queued_prefill_tokens=10, running=1, used_blocks=3, free_blocks=61), ReplicaLoad(1))


def test_first_heartbeat_registers_and_later_ones_refresh(registry: Registry) -> None:
    assert registry.heartbeat(info("prefill-0"), LOADS) is False
    registry.heartbeat(info("prefill-0"), (ReplicaLoad(0, running=2), ReplicaLoad(1)))
    (state,) = registry.nodes()
    assert state.info.node_id == "prefill-0" and state.healthy and not state.draining
    assert state.replicas[0].running == 2
    assert abs(state.heartbeat_at - time.time()) < 0.5


def test_a_node_is_judged_by_the_ttl_its_heartbeats_carry(registry: Registry, config: RegistryConfig) -> None:
    """A node started with a longer --ttl-s stays healthy through a silence longer than the reader's TTL."""
    patient = Registry(RegistryConfig(url=config.url, cluster=config.cluster, ttl_s=30.0, heartbeat_s=1.0))
    try:
        patient.heartbeat(info("decode-0", "decode"), ())
        registry.heartbeat(info("prefill-0"), LOADS)
        time.sleep(config.ttl_s + 0.5)  # both silent past the reader's TTL (1 s)
        (state,) = registry.nodes()  # prefill-0's own 1 s TTL ran out: it is gone
        assert state.info.node_id == "decode-0" and state.healthy and state.ttl_s == 30.0
        view = RegistryView(registry, refresh_s=60.0)  # one refresh; the snapshot then ages by each node's TTL
        view.start()
        try:
            assert view.wait_for(lambda nodes: [n.info.node_id for n in nodes] == ["decode-0"], timeout_s=5)
            assert view.snapshot()[0].healthy
        finally:
            view.stop()
    finally:
        patient.close()



def test_a_stepped_wall_clock_does_not_age_the_view(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The time since a refresh is counted on the monotonic clock: an hour's step of the wall clock (NTP,
    a VM resumed from a snapshot) keeps every node as healthy as it was; monotonic time past the TTL does not."""
    registry.heartbeat(info("prefill-0"), LOADS)
    view = RegistryView(registry, refresh_s=60.0)  # one refresh, then only the clocks move
    view.start()
    try:
        assert view.wait_for(lambda nodes: len(nodes) == 1, timeout_s=5)
        wall, mono = time.time, time.monotonic
        monkeypatch.setattr(time, "time", lambda: wall() + 3600.0)
        assert view.snapshot()[0].healthy
        monkeypatch.setattr(time, "monotonic", lambda: mono() + registry.config.ttl_s + 1.0)
        assert not view.snapshot()[0].healthy
    finally:
        monkeypatch.undo()
        view.stop()

def test_nodes_sorted_by_role_then_id(registry: Registry) -> None:
    for node_id, role in [("prefill-1", "prefill"), ("decode-0", "decode"), ("prefill-0", "prefill")]:
        registry.heartbeat(info(node_id, role), ())
    assert [s.info.node_id for s in registry.nodes()] == ["decode-0", "prefill-0", "prefill-1"]


def test_a_silent_node_expires_and_leaves_the_index(registry: Registry, config: RegistryConfig) -> None:
    registry.heartbeat(info("prefill-0"), LOADS)
    registry.heartbeat(info("decode-0", "decode"), ())
    deadline = time.monotonic() + config.ttl_s + 0.5
    while time.monotonic() < deadline:  # decode-0 keeps beating, prefill-0 went silent
        registry.heartbeat(info("decode-0", "decode"), ())
        time.sleep(config.heartbeat_s)
    assert [s.info.node_id for s in registry.nodes()] == ["decode-0"]
    raw = redis.Redis.from_url(config.url, decode_responses=True)
    assert raw.smembers(f"{config.cluster}:nodes") == {"decode-0"}
    raw.close()


def test_a_failed_node_leaves_its_reason_until_it_registers_again(registry: Registry, config: RegistryConfig,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    registry.heartbeat(info("prefill-0"), LOADS)
    registry.heartbeat(info("decode-0", "decode"), ())
    registry.record_failure(NodeFailure("prefill-0", "prefill", "rank 3 exited with code -9", 100.0))
    registry.record_failure(NodeFailure("decode-0", "decode", "replica 1: timed out", 200.0))
    registry.deregister("prefill-0")
    registry.deregister("decode-0")
    assert registry.nodes() == []
    assert [(f.node_id, f.why) for f in registry.failures()] == [  # newest first
        ("decode-0", "replica 1: timed out"), ("prefill-0", "rank 3 exited with code -9")]
    registry.heartbeat(info("prefill-0"), LOADS)  # restarted: serving again, the old failure is past
    assert [f.node_id for f in registry.failures()] == ["decode-0"]
    raw = redis.Redis.from_url(config.url, decode_responses=True)
    try:
        assert raw.pttl(f"{config.cluster}:failed:decode-0") > (FAILURE_TTL_S - 60) * 1000
        raw.delete(f"{config.cluster}:failed:decode-0")  # as its TTL would: the index is pruned by readers
        assert registry.failures() == []
        assert raw.smembers(f"{config.cluster}:failed") == set()
    finally:
        raw.close()


def test_draining_survives_heartbeats_and_clears_on_deregister(registry: Registry) -> None:
    assert registry.set_draining("prefill-0", True) is False  # unknown node
    registry.heartbeat(info("prefill-0"), LOADS)
    assert registry.set_draining("prefill-0", True) is True
    assert registry.heartbeat(info("prefill-0"), LOADS) is True
    assert registry.heartbeat(info("prefill-0"), LOADS) is True
    assert registry.nodes()[0].draining
    assert registry.set_draining("prefill-0", False) is True
    assert registry.heartbeat(info("prefill-0"), LOADS) is False
    registry.set_draining("prefill-0", True)
    registry.deregister("prefill-0")
    assert registry.nodes() == []
    assert registry.heartbeat(info("prefill-0"), LOADS) is False  # a new life starts undrained


def test_a_draining_node_sets_its_flag_again_after_redis_loses_everything(registry: Registry,
                                                                         config: RegistryConfig) -> None:
    registry.heartbeat(info("prefill-0"), LOADS)
    registry.set_draining("prefill-0", True)
    was = registry.heartbeat(info("prefill-0"), LOADS)
    assert was
    raw = redis.Redis.from_url(config.url)
    raw.flushdb()  # as a restart of a Redis without persistence
    raw.close()
    assert registry.heartbeat(info("prefill-0"), LOADS, was_draining=was) is True
    assert registry.nodes()[0].draining  # the proxy sees it draining again
    assert registry.set_draining("prefill-0", False) is True  # and an undrain still works
    assert registry.heartbeat(info("prefill-0"), LOADS, was_draining=True) is False  # the record existed


def test_two_clusters_on_one_redis_do_not_see_each_other(server: RedisServer) -> None:
    a = Registry(RegistryConfig(url=server.url, cluster="alpha", ttl_s=1.0, heartbeat_s=0.25))
    b = Registry(RegistryConfig(url=server.url, cluster="beta", ttl_s=1.0, heartbeat_s=0.25))
    try:
        a.heartbeat(info("prefill-0"), ())
        b.heartbeat(info("prefill-0"), ())
        b.heartbeat(info("decode-0", "decode"), ())
        a.set_draining("prefill-0", True)
        assert [s.info.node_id for s in a.nodes()] == ["prefill-0"]
        assert [(s.info.node_id, s.draining) for s in b.nodes()] == [("decode-0", False), ("prefill-0", False)]
        assert b.set_draining("decode-0", True) and not a.set_draining("decode-0", True)
    finally:
        a.close()
        b.close()


def test_a_node_re_registers_after_redis_loses_everything(registry: Registry, config: RegistryConfig) -> None:
    registry.heartbeat(info("prefill-0"), ())
    raw = redis.Redis.from_url(config.url)
    raw.delete(f"{config.cluster}:node:prefill-0", f"{config.cluster}:nodes")  # as after a restart
    raw.close()
    assert registry.nodes() == []
    registry.heartbeat(info("prefill-0"), ())
    assert [s.info.node_id for s in registry.nodes()] == ["prefill-0"]


def test_unreachable_redis_raises_registry_error() -> None:
    registry = Registry(RegistryConfig(url=f"redis://127.0.0.1:{free_port()}/0", ttl_s=1.0, heartbeat_s=0.25))
    with pytest.raises(RegistryError, match="read nodes failed"):
        registry.nodes()
    with pytest.raises(RegistryError, match="heartbeat failed"):
        registry.heartbeat(info("prefill-0"), ())
    registry.close()


def ids(nodes: list[NodeState]) -> list[str]:
    return [n.info.node_id for n in nodes]


def test_view_refreshes_at_once_on_notifications(registry: Registry) -> None:
    view = RegistryView(registry, refresh_s=30.0)  # so only a notification can explain a prompt refresh
    view.start()
    try:
        assert view.snapshot() == []
        t0 = time.monotonic()
        registry.heartbeat(info("prefill-0"), LOADS)
        assert view.wait_for(lambda nodes: ids(nodes) == ["prefill-0"], timeout_s=2.0)
        registry.set_draining("prefill-0", True)
        assert view.wait_for(lambda nodes: nodes[0].draining, timeout_s=2.0)
        registry.deregister("prefill-0")
        assert view.wait_for(lambda nodes: nodes == [], timeout_s=2.0)
        assert time.monotonic() - t0 < 2.0
        assert view.last_error is None
    finally:
        view.stop()


def test_view_polls_for_load_changes(registry: Registry) -> None:
    registry.heartbeat(info("prefill-0"), (ReplicaLoad(0),))
    view = RegistryView(registry, refresh_s=0.1)
    view.start()
    try:
        assert ids(view.snapshot()) == ["prefill-0"]  # start() takes a first snapshot
        registry.heartbeat(info("prefill-0"), (ReplicaLoad(0, running=5),))  # no notification for load
        assert view.wait_for(lambda nodes: nodes[0].replicas[0].running == 5, timeout_s=2.0)
        assert not view.wait_for(lambda nodes: nodes == [], timeout_s=0.2)
    finally:
        view.stop()


def test_view_survives_redis_going_away(tmp_path) -> None:
    server = start_redis()
    config = RegistryConfig(url=server.url, cluster="gone", ttl_s=1.0, heartbeat_s=0.25)
    registry = Registry(config)
    view = RegistryView(registry, refresh_s=0.1)
    try:
        registry.heartbeat(info("prefill-0"), LOADS)
        view.start()
        assert view.wait_for(lambda nodes: ids(nodes) == ["prefill-0"] and nodes[0].healthy, timeout_s=2.0)
        server.stop()
        deadline = time.monotonic() + 3.0
        while view.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert view.last_error is not None and "registry" in view.last_error
        assert ids(view.snapshot()) == ["prefill-0"]  # the last list is kept ...
        # ... and its nodes stay as healthy as at the last refresh, past the TTL: no heartbeat can arrive
        # while Redis is away (the proxy probes the nodes itself meanwhile, proxy.routing.breaker).
        assert not view.wait_for(lambda nodes: not nodes[0].healthy, timeout_s=config.ttl_s + 1.0)
        # Redis restarts empty: the node is kept (healthy) for one TTL while it would re-register ...
        server = start_redis(port=server.port)
        assert view.wait_for(lambda nodes: view.last_error is None, timeout_s=3.0)
        assert ids(view.snapshot()) == ["prefill-0"] and view.snapshot()[0].healthy
        # ... and dropped once the TTL passes without its heartbeat.
        assert view.wait_for(lambda nodes: nodes == [], timeout_s=config.ttl_s + 2.0)
    finally:
        view.stop()
        registry.close()
        server.stop()


def test_view_starts_without_redis_and_recovers(tmp_path) -> None:
    port = free_port()
    config = RegistryConfig(url=f"redis://127.0.0.1:{port}/0", cluster="late", ttl_s=1.0, heartbeat_s=0.25)
    registry = Registry(config)
    view = RegistryView(registry, refresh_s=0.1)
    view.start()
    server = None
    try:
        assert view.last_error is not None and view.snapshot() == []
        server = start_redis(port=port)
        registry.heartbeat(info("decode-0", "decode"), ())
        assert view.wait_for(lambda nodes: ids(nodes) == ["decode-0"], timeout_s=3.0)
        assert view.last_error is None
    finally:
        view.stop()
        registry.close()
        if server is not None:
            server.stop()


def test_kv_events_reach_a_subscriber_and_follow_into_the_prefix_index(registry: Registry) -> None:
    """Nodes publish their caches' stored and evicted block hashes; the proxy's follower applies them."""
    import asyncio

    from cluster.nodes import KVEvents
    from proxy.routing.kv_events import follow_kv_events
    from proxy.routing.prefix_index import PrefixIndex

    stream = registry.kv_event_stream()
    registry.publish_kv_events([KVEvents("prefill-0", 1, 100.0, stored=(11, 12, 13)),
                                KVEvents("prefill-0", 0, 100.0)])  # empty: not sent
    got = stream.poll(2.0)
    assert got == [KVEvents("prefill-0", 1, 100.0, stored=(11, 12, 13))]
    stream.close()

    index = PrefixIndex()

    async def follow() -> None:
        task = asyncio.ensure_future(follow_kv_events(registry.kv_event_stream, index, lambda node: 64))
        await asyncio.sleep(0.3)  # subscribed
        registry.publish_kv_events([KVEvents("prefill-0", 1, 100.0, stored=(21, 22, 23))])
        registry.publish_kv_events([KVEvents("prefill-0", 1, 100.0, removed=(23,))])
        deadline = time.monotonic() + 5
        while index.expected_hit("prefill-0", 1, [21, 22, 23]) != 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # the node restarted: what it held before is gone
        registry.publish_kv_events([KVEvents("prefill-0", 1, 200.0, stored=(31,))])
        while index.expected_hit("prefill-0", 1, [21]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(follow())
    assert index.expected_hit("prefill-0", 1, [21, 22]) == 0
    assert index.expected_hit("prefill-0", 1, [31]) == 1
