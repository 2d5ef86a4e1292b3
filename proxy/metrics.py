"""Prometheus metrics of one proxy, in a registry of its own (two apps in one process don't clash).

The request path's counts and observations (``ProxyMetrics.add`` and ``observe``) are tallied in dicts
of plain numbers and added to their series by ``flush``: when ``/metrics`` is rendered, and every
``FLUSH_S`` for the other workers' pages. Each update straight into a series takes its lock, and a
labelled one finds its child first: under load that was ~9% of a worker's CPU per request
(cProfile, docs/benchmarks.md). Rare events (errors, circuit states) update their series directly.

Also the ASGI middleware that counts requests by endpoint and status code: a pure ASGI wrapper,
not Starlette's ``BaseHTTPMiddleware``, which would sit between streaming responses and the
client's disconnect.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

PREFIX = "pdcluster_proxy"
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: where each worker writes its series

FLUSH_S = 1.0  # how stale another worker's tallies may be in a /metrics page (multiprocess mode)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ProxyMetrics:
    """The proxy's series; ``render()`` gives the exposition text of ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "Failed requests by cause", ["cause"], registry=r)
        self.registry_up = Gauge(f"{PREFIX}_registry_up", "1 while the registry answers, 0 while the proxy routes "
                                 "on its last view", registry=r, multiprocess_mode="min")
        self.circuit = Gauge(f"{PREFIX}_node_circuit_state", "Each node's circuit breaker: 0 closed, 1 half-open, "
                             "2 open", ["node_id"], registry=r, multiprocess_mode="max")
        self.inflight = Gauge(f"{PREFIX}_inflight_requests", "Generation requests in flight", registry=r,
                              multiprocess_mode="livesum")
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to first token",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_request_latency_seconds", "Request arrival to last token",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer_s = Histogram(f"{PREFIX}_kv_transfer_seconds", "KV transfer time (decode node's report)",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        # A request's phases, for the split of TTFT and of the first decode step (benchmarks/serve.py):
        self.prefill_queue_s = Histogram(f"{PREFIX}_prefill_queue_seconds",
                                         "Waiting on the prefill node before the first prefill step (node's report)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_s = Histogram(f"{PREFIX}_prefill_seconds", "Prefill node: first prefill step to first token "
                                   "(node's report)", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_rpc_s = Histogram(f"{PREFIX}_prefill_rpc_seconds", "The Prefill call as the proxy waits for it "
                                       "(route to answer)", buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_admission_s = Histogram(f"{PREFIX}_decode_admission_seconds",
                                            "Decode call opened to the request admitted there (KV pulled, or a "
                                            "local prefill queued)", buckets=_LATENCY_BUCKETS, registry=r)
        self.first_decode_token_s = Histogram(f"{PREFIX}_first_decode_token_seconds",
                                              "Decode call opened to its first tokens event",
                                              buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer_bytes = Counter(f"{PREFIX}_kv_transfer_bytes", "KV bytes moved from prefill to decode",
                                         registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_prefix_cached_tokens",
                                     "Prompt tokens found in a node's prefix cache (prefill: not computed; decode: "
                                     "not pulled); over prompt_tokens, the hit rate", ["leg"], registry=r)
        self.kv_events = Counter(f"{PREFIX}_kv_event_messages", "Nodes' KV event messages applied to the prefix index",
                                 registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Output tokens received", registry=r)
        self.routing = Counter(f"{PREFIX}_routing_decisions", "Routing decisions by role and node",
                               ["role", "node_id"], registry=r)

        for histogram in [m for m in vars(self).values() if isinstance(m, Histogram)]:
            if not hasattr(histogram, "_upper_bounds"):  # observe() reads it: prometheus_client's layout
                raise RuntimeError("prometheus_client's Histogram has no _upper_bounds: update ProxyMetrics")
        self._added: dict[tuple[Counter, tuple[str, ...]], float] = {}
        self._observed: dict[tuple[Histogram, tuple[str, ...]], list[float]] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def add(self, counter: Counter, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        """``counter.labels(*labels).inc(amount)``, at the next ``flush``."""
        key = (counter, labels)
        added = self._added
        added[key] = added.get(key, 0.0) + amount

    def observe(self, histogram: Histogram, value: float, labels: tuple[str, ...] = (), count: int = 1) -> None:
        """``count`` observations of ``value`` (``histogram.labels(*labels).observe``), at the next ``flush``."""
        if count <= 0:
            return
        key = (histogram, labels)
        tally = self._observed.get(key)
        if tally is None:  # the sum, then one count per bucket
            tally = self._observed[key] = [0.0] * (1 + len(histogram._upper_bounds))
        tally[0] += value * count
        if value != value:  # NaN: in the sum only, as Histogram.observe (no bucket's bound is >= it)
            return
        # the first bucket whose bound is >= value, as Histogram.observe's
        tally[1 + bisect_left(histogram._upper_bounds, value)] += count

    def flush(self) -> None:
        """Add the tallies to their series (in multiprocess mode: where every worker's page reads them)."""
        added, self._added = self._added, {}
        for (counter, labels), amount in added.items():
            self._child(counter, labels).inc(amount)
        observed, self._observed = self._observed, {}
        for (histogram, labels), tally in observed.items():
            child = self._child(histogram, labels)
            child._sum.inc(tally[0])
            for bucket, count in zip(child._buckets, tally[1:]):
                if count:
                    bucket.inc(count)

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels) if labels else metric
        return child

    def render(self) -> bytes:
        """The exposition text: this process's series or, with several proxy workers (prometheus_client's
        multiprocess mode, ``$PROMETHEUS_MULTIPROC_DIR`` set before it was imported), every worker's
        summed (the inflight gauge over live workers; other workers' tallies as of their last flush)."""
        self.flush()
        if os.environ.get(MULTIPROC_DIR):
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: count every HTTP request by endpoint (known paths only) and status."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics, endpoint_of: Callable[[str], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoint_of = endpoint_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except BaseException:
            status = status or 500
            raise
        finally:
            # 499 (nginx's "client closed request"): the client left before any answer.
            self.metrics.add(self.metrics.requests, (self.endpoint_of(scope.get("path", "")), str(status or 499)))

