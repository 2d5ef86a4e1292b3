"""Faults injected into a whole running cluster (started as ``pdctl up`` starts it), under load.

One PCP2 prefill node with expert parallelism over its two rank processes (EP2), a DP1 decode node and
a DP2 decode node with expert parallelism over its two replica processes (EP2, a 15 s collective timeout),
the proxy with a 4 s token timeout, 6 s prefill leases. In file order: a decode node hung with SIGSTOP
mid-stream, Redis SIGKILLed under load and restarted on its port, a prefill EP rank SIGKILLed under load,
one replica of the EP decode node hung with SIGSTOP under load, the proxy SIGKILLed with requests in
flight. Each test ends with every node at 0 used KV blocks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster, wait_all_free

from pdctl.launcher import REDIS, read_state, write_state
from pdctl.process_group import record_of
from pdctl.redis_server import start_redis
from pdctl.topology import Topology

MODEL = "tiny"
TOKEN_TIMEOUT_S = 4.0
LEASE_S = 6.0
EP_TIMEOUT_S = 15.0  # the EP decode node's rank_timeout_s: a hung replica fails the group after this


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("chaos")
    topo = Topology.from_dict({
        "model": str(tiny_model),
        "served_model_name": MODEL,
        "registry": {"cluster": f"chaos-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY, "token_timeout_s": TOKEN_TIMEOUT_S},
        "prefill": [{"pcp": 2, "kv_layout": "sharded", "max_model_len": 1024, "max_num_batched_tokens": 256,
                     "num_kv_blocks": 256, "lease_s": LEASE_S, "enable_expert_parallel": True}],
        "decode": [{"max_model_len": 1024, "num_kv_blocks": 256, "transfer_timeout_s": 5},
                   {"dp": 2, "max_model_len": 1024, "num_kv_blocks": 256, "transfer_timeout_s": 5,
                    "enable_expert_parallel": True, "rank_timeout_s": EP_TIMEOUT_S}],
    })
    with running_cluster(topo, run_dir, tiny_model, cluster_run_dirs) as c:
        yield c


def pid_of(c: Cluster, name: str) -> int:
    state = read_state(c.run_dir)
    assert state is not None
    return next(p.pid for p in state.processes if p.name == name)


def complete(c: Cluster, prompt: str = "hello", max_tokens: int = 8, timeout_s: float = 30.0) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True}, timeout=timeout_s)


class Load:
    """``workers`` clients sending requests back to back until stopped; every status is kept."""

    def __init__(self, c: Cluster, workers: int = 6) -> None:
        self.statuses: list[int | str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c, i), daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self, c: Cluster, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                self.statuses.append(complete(c, f"load {i} {n}", 6).status_code)
            except httpx.HTTPError as e:
                self.statuses.append(type(e).__name__)
            n += 1

    def stop(self) -> list[int | str]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.statuses


def open_streams(c: Cluster, n: int, events_each: int = 2) -> tuple[list[list[dict]], list[threading.Thread]]:
    """``n`` long streams, returned once each has sent ``events_each`` events; they keep reading."""
    body = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 900, "temperature": 0, "stream": True,
            "ignore_eos": True}
    events: list[list[dict]] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1)

    def read(i: int) -> None:
        signalled = False
        try:
            with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events[i].append(json.loads(line[6:]))
                    if not signalled and len(events[i]) >= events_each:
                        signalled = True
                        started.wait(30)
        except httpx.HTTPError as e:
            events[i].append({"error": {"message": f"client: {type(e).__name__}"}})
        finally:
            if not signalled:
                started.wait(30)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(60)
    return events, threads


def test_a_hung_decode_node_ends_its_streams_then_is_routed_around_and_comes_back(cluster: Cluster) -> None:
    cluster.admin.post("/admin/nodes/decode-1/drain").raise_for_status()  # the streams land on decode-0
    victim = pid_of(cluster, "decode-0")
    events, threads = open_streams(cluster, 3)
    os.killpg(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        cluster.admin.post("/admin/nodes/decode-1/undrain").raise_for_status()
        for t in threads:
            t.join(TOKEN_TIMEOUT_S + 10)
        ended = time.monotonic() - stopped_at
        assert ended < TOKEN_TIMEOUT_S + 5, f"the streams took {ended:.1f}s to end"
        for ev in events:  # each ends with an error event, after its tokens
            assert "error" in ev[-1] and all("error" not in e for e in ev[:-1]), ev[-1]
        # Once its heartbeat has expired, new requests go to decode-1 without waiting on the hung node.
        assert wait_until(lambda: not cluster.nodes()["decode-0"]["healthy"], 15)
        for _ in range(3):
            t0 = time.monotonic()
            assert complete(cluster).status_code == 200
            assert time.monotonic() - t0 < 3
    finally:
        os.killpg(victim, signal.SIGCONT)
    # Back: its heartbeat resumes, it is routable again and serves.
    assert wait_until(lambda: cluster.nodes()["decode-0"]["healthy"], 15)
    cluster.admin.post("/admin/nodes/decode-1/drain").raise_for_status()
    try:
        assert wait_until(lambda: complete(cluster).status_code == 200, 10)
    finally:
        cluster.admin.post("/admin/nodes/decode-1/undrain").raise_for_status()
    used = wait_all_free(cluster)
    assert not any(used.values()), used


def test_redis_killed_under_load_and_restarted_on_its_port(cluster: Cluster) -> None:
    state = read_state(cluster.run_dir)
    assert state is not None
    redis = next(p for p in state.processes if p.name == REDIS)
    load = Load(cluster)
    time.sleep(1.0)
    os.kill(redis.pid, signal.SIGKILL)
    assert wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=5).json().get("registry") == "stale", 10)
    time.sleep(6.0)  # past the registry's 5 s TTL: the proxy serves on its last view all along
    assert httpx.get(f"{cluster.url}/health", timeout=5).status_code == 200
    server = start_redis(redis.port, data_dir=cluster.run_dir / "redis-restarted")
    # `pdctl down` stops the new one (the state file is where it looks)
    others = tuple(p for p in state.processes if p.name != REDIS)
    write_state(cluster.run_dir, replace(state, processes=(record_of(REDIS, server.pid, server.log_path, server.port),
                                                           *others)))
    assert wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=5).json().get("registry") == "ok", 15)
    assert wait_until(lambda: len(cluster.nodes()) == 3, 10)  # the nodes registered again
    time.sleep(1.0)
    statuses = load.stop()
    assert len(statuses) > 20 and all(s == 200 for s in statuses), [s for s in statuses if s != 200]
    used = wait_all_free(cluster)
    assert not any(used.values()), used


def spawned(c: Cluster, node: str) -> list[psutil.Process]:
    """A node's rank or replica processes."""
    return [p for p in psutil.Process(pid_of(c, node)).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline())]


def test_a_prefill_ep_rank_killed_under_load_fails_only_its_requests(cluster: Cluster) -> None:
    """Its peer waits on it in every MoE layer's collectives: the node fails as fast as without EP."""
    ranks = spawned(cluster, "prefill-0")
    assert len(ranks) == 2, "the PCP2 prefill node has no rank processes"
    assert cluster.nodes()["prefill-0"]["ep"] == 2
    load = Load(cluster)
    time.sleep(1.5)
    ranks[-1].kill()
    # A rank failure stops its node; the decode nodes then prefill locally (the proxy's fallback).
    assert wait_until(lambda: "prefill-0" not in cluster.nodes(), 20)
    assert re.search(r"rank \d", failed_why(cluster, "prefill-0"))  # what `pdctl status` says of it
    time.sleep(2.0)
    statuses = load.stop()
    failed = [s for s in statuses if s != 200]
    assert all(s in (502, 503) for s in failed), failed  # the requests on the dead node, as errors
    assert len(failed) <= 12, failed
    assert all(s == 200 for s in statuses[-6:]), statuses[-6:]  # served again, without the prefill node
    used = wait_all_free(cluster)
    assert not any(used.values()), used


def test_a_hung_replica_of_an_ep_decode_node_fails_its_group_and_is_routed_around(cluster: Cluster) -> None:
    """One replica process of decode-1 (EP2) SIGSTOPped under load: its peer blocks in a collective until the
    group's timeout, then the node fails and leaves the registry; meanwhile its requests end with errors
    (the proxy's token timeout); afterwards decode-0 serves everything and no block stays used."""
    assert cluster.nodes()["decode-1"]["ep"] == 2
    replicas = spawned(cluster, "decode-1")
    assert len(replicas) == 2
    load = Load(cluster)
    time.sleep(1.5)
    stopped_at = time.monotonic()
    replicas[1].suspend()
    try:
        assert wait_until(lambda: "decode-1" not in cluster.nodes(), EP_TIMEOUT_S + 20)
        failed_after = time.monotonic() - stopped_at
    finally:
        for p in replicas:
            if p.is_running():
                p.resume()
    time.sleep(2.0)
    statuses = load.stop()
    failed = [s for s in statuses if s != 200]
    assert all(s in (502, 503, 504) for s in failed), failed  # the requests that reached decode-1, as errors
    assert all(s == 200 for s in statuses[-6:]), statuses[-6:]  # served again, by decode-0
    assert failed_after > EP_TIMEOUT_S - 1, failed_after  # (it was the collective's timeout, not a crash)
    assert "Timed out" in failed_why(cluster, "decode-1")  # what `pdctl status` says of it
    used = wait_all_free(cluster)
    assert not any(used.values()), used


def test_the_proxy_killed_with_requests_in_flight_leaves_no_kv_held(cluster: Cluster) -> None:
    proxy = pid_of(cluster, "proxy")
    events, threads = open_streams(cluster, 4)
    os.killpg(proxy, signal.SIGKILL)
    for t in threads:
        t.join(15)
    # The decode streams were cancelled with the connection; anything still held under a lease expires.
    used = wait_all_free(cluster, timeout_s=LEASE_S + 15)
    assert not any(used.values()), used


def failed_why(c: Cluster, node_id: str) -> str:
    """Why ``node_id`` failed, as the admin API (and so ``pdctl status``) reports it."""
    failed = {f["node_id"]: f for f in c.admin.get("/admin/nodes").json()["failed"]}
    return failed[node_id]["why"]


def wait_until(predicate, timeout_s: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.2)
    return False
