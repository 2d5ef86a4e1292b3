"""What both node roles share at run time: the gRPC server's life, the registry heartbeat, signals.

A node is a ``NodeWorker`` (the engine side, on its own threads) plus a gRPC servicer. ``serve``
starts the server on the configured address (port 0: a free one), joins the registry with a
heartbeat thread that publishes the worker's load (and its prefix caches' KV events) every
``heartbeat_s``, and runs until SIGTERM / SIGINT or until the worker fails. Stopping: leave the
registry (no new routing), let in-flight requests finish for up to ``grace_s``, abort the rest, stop
the server and the worker.

The server also answers the standard gRPC health service (``grpc.health.v1.Health``, for compose
healthchecks and Kubernetes' gRPC probes), for ``""`` and for the node's service name: NOT_SERVING
until the registry has taken its first heartbeat, SERVING then, NOT_SERVING from when it starts
stopping.
A draining node stays SERVING: it is alive and serves what it is sent; the drain flag lives in the
registry, for the proxy's routing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster import envs, tls
from cluster.auth import TokenCheck
from cluster.config import NodeConfig
from cluster.grpc_options import SERVER_OPTIONS
from cluster.net import is_loopback
from cluster.nodes import KVEvents, NodeFailure, NodeInfo, ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from engine import envs as engine_envs
from engine.parallel.expert_parallel import ep_size
from node_runtime.metrics import NodeMetrics

T = TypeVar("T")

log = logging.getLogger("pdcluster.node")


class NodeWorker(Protocol):
    failed: threading.Event  # set when the engine can no longer serve (a rank died)
    failure: str | None
    max_model_len: int
    num_blocks: int  # KV blocks of one replica
    block_size: int
    prefix_caching: bool  # whether its engine really caches prefixes (vLLM may turn it off)
    kv_protocol: str  # the Mooncake protocol its KV moves with (``auto`` resolved): decode and prefill must match
    kv_cache_dtype: str  # its KV rows' format (engine.kv_format's wire name): decode and prefill must match
    weights: str  # how its engine holds the weights, in words (pdctl status)
    routed_experts: int  # the model's routed experts (0: no MoE layers)
    address: str  # set by ``serve`` once the server listens: the address peers dial

    def load(self) -> list[ReplicaLoad]: ...

    def transfer_totals(self) -> pb.TransferTotals:
        """KV pulls done, bytes, seconds, failures by cause (decode); leases that ran out (prefill)."""
        ...

    def take_kv_events(self) -> list[tuple[int, list[int], list[int]]]:
        """Per DP replica: (dp rank, hashes its prefix cache stored, hashes it evicted) since the last
        call (replicas without changes are skipped when published)."""
        ...

    def in_flight(self) -> int: ...

    def abort_all(self, why: str) -> None: ...

    def shutdown(self) -> None: ...


def transfer_host(config: NodeConfig) -> str:
    """The address peers reach this node's KV transport at: the advertised host, as an IP."""
    host = config.dial_host
    if host in ("0.0.0.0", "::", ""):
        raise ValueError("listening on all interfaces: set --advertise-host to the address peers dial")
    return socket.gethostbyname(host)


class Heartbeat(threading.Thread):
    """Publishes the node's info and load to the registry."""

    def __init__(self, config: NodeConfig, info: NodeInfo, load: Callable[[], list[ReplicaLoad]],
                 kv_events: Callable[[], list[tuple[int, list[int], list[int]]]] | None = None) -> None:
        super().__init__(name="heartbeat", daemon=True)
        from cluster.registry import Registry

        self.registry = Registry(config.registry)
        self.info = info
        self.load = load
        self.kv_events = kv_events
        self.every_s = config.registry.heartbeat_s
        self.stopped = threading.Event()
        self.registered = threading.Event()  # the registry has taken a heartbeat
        self.last_error: str | None = None
        self.draining = False  # the flag as last heard: set again if the registry loses it

    def beat(self) -> None:
        try:
            # The drain flag is for the proxy; the node only remembers it for the registry's sake.
            self.draining = self.registry.heartbeat(self.info, self.load(), was_draining=self.draining)
            self.registered.set()
            if self.kv_events is not None:  # after the record: readers know the node first
                self.registry.publish_kv_events([KVEvents(self.info.node_id, dp, self.info.started_at,
                                                          tuple(stored), tuple(removed))
                                                 for dp, stored, removed in self.kv_events()])
            if self.last_error:
                log.info("registry reachable again")
            self.last_error = None
        except Exception as e:  # Redis away: keep serving, keep trying (the TTL marks us unhealthy)
            if self.last_error is None:
                log.warning("heartbeat failed: %s", e)
            self.last_error = str(e)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.beat()

    def stop(self, failure: str | None = None) -> None:
        """Leave the registry; ``failure``: why the node stops serving on its own, kept there for ``pdctl``."""
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=10)  # a beat in flight must not re-register us after we leave
        try:
            if failure is not None:
                self.registry.record_failure(NodeFailure(self.info.node_id, self.info.role, failure, time.time()))
            self.registry.deregister(self.info.node_id)
        except Exception as e:
            log.warning("could not deregister: %s", e)
        self.registry.close()


class Lifecycle:
    """Where the node is in its life, for its servicers (they refuse new work once ``stopping``)
    and for the standard health service ``health`` (see the module docstring)."""

    def __init__(self) -> None:
        self.stopping = False
        self.health = health.aio.HealthServicer()
        self._names: tuple[str, ...] = ("",)

    async def starting(self, service: str) -> None:
        """Before the server answers: not serving yet (``HealthServicer`` starts with ``""`` SERVING)."""
        self._names = ("", service)
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        self.stopping = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING for good

    async def _set(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in self._names:
            await self.health.set(name, status)


def service_name(role: str) -> str:
    """The full gRPC name of a role's service: ``pdcluster.v1.PrefillService`` / ``...DecodeService``."""
    return pb.DESCRIPTOR.services_by_name[f"{role.capitalize()}Service"].full_name


def _kv_layout(config: NodeConfig) -> str:
    """How a replica's KV is spread over its ranks: vLLM shards it only with DCP > 1."""
    if config.engine_backend == "vllm":
        return "sharded" if config.dcp > 1 else "replicated"
    return config.engine.kv_layout if config.role == "prefill" else "replicated"


def _ep_size(config: NodeConfig) -> int:
    """The EP group's size: a native node's DP x PCP ranks per stage (a decode node's DP replicas;
    engine.parallel.expert_parallel); vLLM's TP ranks."""
    ec = config.engine
    if not ec.enable_expert_parallel:
        return 1
    return config.tp if config.engine_backend == "vllm" else ep_size(ec)


def _speculative_tokens(config: NodeConfig) -> int:
    spec = config.engine.speculative if config.engine_backend == "native" else None
    return spec.num_speculative_tokens if spec is not None else 0


def node_info(config: NodeConfig, served: str, worker: NodeWorker, metrics_address: str = "") -> NodeInfo:
    """What the node publishes in the registry."""
    ec = config.engine
    ep = _ep_size(config)
    return NodeInfo(node_id=config.node_id, role=config.role, address=worker.address, model=served,
                    max_model_len=worker.max_model_len, dp=ec.dp, pcp=ec.pcp, pp=ec.pp,
                    kv_layout=_kv_layout(config),
                    block_size=worker.block_size, num_blocks=worker.num_blocks, started_at=time.time(),
                    engine=config.engine_backend, kv_protocol=worker.kv_protocol,
                    kv_cache_dtype=worker.kv_cache_dtype, weights=worker.weights, ep=ep,
                    experts_per_rank=worker.routed_experts // ep,
                    local_prefill=config.role == "decode" and config.engine_backend == "native",
                    prefix_caching=worker.prefix_caching, metrics_address=metrics_address,
                    speculative_tokens=_speculative_tokens(config),
                    mtp_recompute=(config.role == "decode" and _speculative_tokens(config) > 0
                                   and config.engine.mtp_recompute))


AddServicer = Callable[[grpc.aio.Server, NodeMetrics], None]  # the role's servicer onto the server


async def serve(config: NodeConfig, worker: NodeWorker, served: str, add_servicer: AddServicer,
                lifecycle: Lifecycle) -> int:
    """Run the node until a signal or a worker failure; returns the process exit code. The worker
    is shut down on every way out."""
    metrics = NodeMetrics(served, config.role, config.node_id)
    try:
        return await _serve(config, worker, served, add_servicer, lifecycle, metrics)
    finally:
        metrics.stop()
        worker.shutdown()


async def _serve(config: NodeConfig, worker: NodeWorker, served: str, add_servicer: AddServicer,
                 lifecycle: Lifecycle, metrics: NodeMetrics) -> int:
    token = envs.cluster_token()
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[TokenCheck(token)] if token else None)
    if token is None and not is_loopback(config.host):
        log.warning("no cluster token ($%s): this node takes gRPC calls from anyone who can reach %s:%d",
                    envs.CLUSTER_TOKEN, config.host, config.port)
    add_servicer(server, metrics)
    await lifecycle.starting(service_name(config.role))
    health_pb2_grpc.add_HealthServicer_to_server(lifecycle.health, server)
    creds = tls.server_credentials()
    where = f"{config.host}:{config.port}"
    port = server.add_insecure_port(where) if creds is None else server.add_secure_port(where, creds)
    if port == 0:
        raise RuntimeError(f"cannot listen on {config.host}:{config.port}")
    worker.address = f"{config.dial_host}:{port}"  # before the first answer can carry it
    await server.start()
    metrics_address = ""
    if config.metrics_port >= 0:
        metrics_address = f"{config.dial_host}:{metrics.start(config.host, config.metrics_port)}"
    info = node_info(config, served, worker, metrics_address)
    metrics.watch(worker, info)
    heartbeat = Heartbeat(config, info, worker.load, worker.take_kv_events if info.prefix_caching else None)
    heartbeat.beat()  # registered before we say we are up
    heartbeat.start()
    log.info("%s %s serving on %s:%d (%s, %s)", config.role, config.node_id, config.host, port,
             "TLS" if creds is not None else "plaintext", "cluster token" if token else "no cluster token")
    print(f"{config.role} node {config.node_id} ready on {info.address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announced = False
    while not stop.is_set() and not worker.failed.is_set():
        if not announced and heartbeat.registered.is_set():  # Redis may have been away at the first beat
            await lifecycle.serving()
            announced = True
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.2)
        except TimeoutError:
            pass
    code = 0
    if worker.failed.is_set():
        log.error("node failed: %s", worker.failure)
        code = 1
    await lifecycle.stop()
    heartbeat.stop((worker.failure or "the engine failed") if code else None)  # leave first: no new requests here
    deadline = time.monotonic() + (config.grace_s if code == 0 else 0.0)
    while worker.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    worker.abort_all("the node is shutting down")
    await server.stop(grace=1.0)
    return code


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on the node's event loop: uvloop where it is installed (as vLLM's servers and our
    proxy run), else asyncio's own. Its futures, callbacks and task steps are compiled: the node's
    gRPC relay of every request's calls and tokens costs less CPU (docs/benchmarks.md)."""
    try:
        import uvloop
    except ImportError:  # not on this platform (pyproject installs it where it builds)
        return asyncio.run(main)
    return uvloop.run(main)


def run(main: Callable[[], Coroutine[Any, Any, int]]) -> None:
    """Process entry: logging, then the node's async main; exits with its code."""
    logging.basicConfig(level=engine_envs.log_level(), format=engine_envs.LOG_FORMAT)
    raise SystemExit(run_loop(main()))
