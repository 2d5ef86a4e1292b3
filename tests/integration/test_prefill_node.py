"""A prefill node process over gRPC: held KV under a lease, freed on Release, Abort or expiry;
bad input answered with INVALID_ARGUMENT; registration in Redis with its shape and load; the
standard health service (grpc.health.v1) answering SERVING.

Prefills go over the node's multiplexed stream with the proxy's client (``mux_calls``), as every
request of a cluster does; bad input is checked on the plain ``Prefill`` RPC too."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mux_calls import mux_prefill
from procs import wait_registered, wait_until

from cluster.config import RegistryConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.registry import Registry
from node_runtime.server import Lifecycle, service_name
from pdctl.redis_server import start_redis

PROMPT = [(i * 7 + 3) % 1000 + 2 for i in range(100)]  # 7 blocks of 16


@dataclass
class Node:
    stub: pb_grpc.PrefillServiceStub  # Release, Abort, Stats (and the plain Prefill)
    registry: Registry
    address: str  # prefills go over its multiplexed stream (mux_prefill)


@pytest.fixture(scope="module")
def node(tiny_model: Path) -> Iterator[Node]:
    redis = start_redis()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefill_node", "--model", str(tiny_model), "--node-id", "p0", "--registry-url",
         redis.url, "--cluster", "t", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
         "--num-kv-blocks", "64", "--lease-s", "3", "--grace-s", "2"],
        start_new_session=True)
    registry = Registry(RegistryConfig(url=redis.url, cluster="t"))
    try:
        address = wait_registered(proc, registry).info.address
        channel = grpc.insecure_channel(address)
        yield Node(pb_grpc.PrefillServiceStub(channel), registry, address)
        channel.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0  # a clean stop: in-flight finished or aborted, registry left
        assert not registry.nodes()
        registry.close()
        redis.stop()


def prefill(node: Node, rid: str, max_tokens: int = 8, prompt: list[int] = PROMPT) -> pb.PrefillResponse:
    req = pb.PrefillRequest(request_id=rid, token_ids=prompt, dp_rank=-1,
                            sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens))
    return mux_prefill(node.address, req)


def used(stub: pb_grpc.PrefillServiceStub) -> int:
    return sum(r.used_blocks for r in stub.Stats(pb.StatsRequest(), timeout=10).replicas)


def test_registers_its_shape(node) -> None:
    registry = node.registry
    (n,) = registry.nodes()
    assert (n.info.role, n.info.dp, n.info.pcp, n.info.pp, n.info.max_model_len) == ("prefill", 1, 1, 1, 512)
    assert n.healthy and n.replicas[0].free_blocks == 64


def test_answers_grpc_health_serving(node) -> None:
    registry = node.registry
    with grpc.insecure_channel(registry.nodes()[0].info.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "pdcluster.v1.PrefillService"):
            r = check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as e:  # not a decode node
            check(health_pb2.HealthCheckRequest(service="pdcluster.v1.DecodeService"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_lifecycle_health_before_registration_and_when_stopping() -> None:
    assert service_name("prefill") == "pdcluster.v1.PrefillService"

    async def statuses(lifecycle: Lifecycle) -> list[int]:
        return [(await lifecycle.health.Check(health_pb2.HealthCheckRequest(service=s), None)).status
                for s in ("", "pdcluster.v1.DecodeService")]

    async def run() -> None:
        lifecycle = Lifecycle()
        await lifecycle.starting(service_name("decode"))
        assert await statuses(lifecycle) == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
        await lifecycle.serving()
        assert await statuses(lifecycle) == [health_pb2.HealthCheckResponse.SERVING] * 2
        await lifecycle.stop()
        assert lifecycle.stopping
        assert await statuses(lifecycle) == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2

    asyncio.run(run())


def test_held_kv_is_freed_by_release_abort_or_lease_expiry(node) -> None:
    stub = node.stub
    a = prefill(node, "a")
    assert a.finish_reason == "" and a.kv.num_blocks == 7 and len(a.kv.sources) == 1
    assert used(stub) == 7
    assert stub.Release(pb.ReleaseRequest(request_id="a"), timeout=10).found  # the decode side confirmed
    # answered at once, the blocks freed between two steps
    wait_until(lambda: used(stub) == 0, 5, "the released blocks to be freed")
    prefill(node, "b")
    stub.Abort(pb.AbortRequest(request_id="b"), timeout=10)
    assert used(stub) == 0
    prefill(node, "c")  # nobody confirms: the 3 s lease frees it
    assert used(stub) == 7

    def expired() -> bool:
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        return sum(r.used_blocks for r in stats.replicas) == 0 and stats.transfers.leases_expired == 1

    wait_until(expired, 3 + 10, "the unconfirmed lease to expire and its blocks to be freed")
    assert not stub.Release(pb.ReleaseRequest(request_id="c"), timeout=10).found


def test_a_one_token_request_holds_nothing(node) -> None:
    stub = node.stub
    r = prefill(node, "one", max_tokens=1)
    assert r.finish_reason == "length" and not r.HasField("kv")
    assert used(stub) == 0


@pytest.mark.parametrize("req", [
    pb.PrefillRequest(request_id="", token_ids=[1, 2]),
    pb.PrefillRequest(request_id="x", token_ids=[]),
    pb.PrefillRequest(request_id="x", token_ids=[1, 10**6]),
    pb.PrefillRequest(request_id="x", token_ids=list(range(2, 600))),
    pb.PrefillRequest(request_id="x", token_ids=[1, 2], dp_rank=3),
    pb.PrefillRequest(request_id="x", token_ids=[1, 2], sampling=pb.SamplingParams(temperature=-1)),
])
@pytest.mark.parametrize("path", ["mux", "rpc"])
def test_bad_input_is_invalid_argument(node, req: pb.PrefillRequest, path: str) -> None:
    stub = node.stub
    with pytest.raises(grpc.RpcError) as e:
        if path == "mux":
            mux_prefill(node.address, req, 30)
        else:
            stub.Prefill(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert used(stub) == 0


def test_requests_that_once_crashed_a_node_are_served(node) -> None:
    stub = node.stub
    for i, sp in enumerate([pb.SamplingParams(max_tokens=8, min_tokens=3),  # min_tokens > the one prefill token
                            pb.SamplingParams(max_tokens=8, temperature=1e-30)]):  # a "greedy" temperature
        r = mux_prefill(node.address, pb.PrefillRequest(request_id=f"odd{i}", token_ids=PROMPT, sampling=sp))
        assert r.finish_reason == "" and r.kv.num_blocks == 7
        stub.Abort(pb.AbortRequest(request_id=f"odd{i}"), timeout=10)
    assert used(stub) == 0


def test_a_full_cache_of_held_kv_makes_new_prefills_wait_not_fail(node) -> None:
    import concurrent.futures

    stub = node.stub
    held = [f"h{i}" for i in range(9)]  # 9 x 7 = 63 of the 64 blocks, all under leases
    for k, rid in enumerate(held):  # prompts that differ from their first block on: nothing is shared
        prefill(node, rid, prompt=[k + 2] + PROMPT[1:])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(prefill, node, "late", prompt=[500] + PROMPT[1:])

        def queued() -> bool:  # the load is published after a step, so a step found no room for it
            (replica,) = stub.Stats(pb.StatsRequest(), timeout=10).replicas
            return replica.waiting == 1 and replica.held == len(held)

        wait_until(queued, 30, "the late prefill to wait in the node's queue")
        assert not waiting.done()  # no room: it waits for a held request to go
        assert stub.Release(pb.ReleaseRequest(request_id=held[0]), timeout=10).found
        assert waiting.result(timeout=30).kv.num_blocks == 7
    for rid in held[1:] + ["late"]:
        stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
    assert used(stub) == 0
