"""Prometheus metrics of one proxy, in a registry of its own (two apps in one process don't clash).

The request path's counts and observations (``ProxyMetrics.add`` and ``observe``: ``cluster.metrics.Tally``)
are added to their series by ``flush``: when ``/metrics`` is rendered, and every ``FLUSH_S`` for the
other workers' pages. Rare events (errors, circuit states) update their series directly.

Besides its own ``pdcluster_proxy_*`` families the proxy exposes vLLM's request-level ones (TTFT,
inter-token latency, end-to-end latency, prompt and generation tokens), labelled
``model_name`` and ``role="proxy"``: fed from its own series (``Tally.mirror``), they cost the request
path nothing more.

Also the ASGI middleware that counts requests by endpoint and status code: a pure ASGI wrapper,
not Starlette's ``BaseHTTPMiddleware``, which would sit between streaming responses and the
client's disconnect.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from cluster import metrics as vllm_names
from cluster.metrics import Tally

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


class ProxyMetrics(Tally):
    """The proxy's series; ``render()`` gives the exposition text of ``/metrics``."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__()
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

        self._vllm_series(model_name)

    def _vllm_series(self, model_name: str) -> None:
        """vLLM's request-level families, fed by the proxy's own (module docstring)."""
        r, labels, names = self.registry, ("model_name", "role"), (model_name, "proxy")
        self.mirror(self.ttft, Histogram(vllm_names.TTFT, "Request arrival to first token (at the proxy)", labels,
                                         buckets=vllm_names.TTFT_BUCKETS, registry=r), names)
        self.mirror(self.itl, Histogram(vllm_names.ITL, "Time between output tokens (at the proxy)", labels,
                                        buckets=vllm_names.ITL_BUCKETS, registry=r), names)
        self.mirror(self.e2e, Histogram(vllm_names.E2E, "Request arrival to last token (at the proxy)", labels,
                                        buckets=vllm_names.REQUEST_BUCKETS, registry=r), names)
        self.mirror(self.prompt_tokens, Counter(vllm_names.PROMPT_TOKENS, "Prompt tokens of routed requests",
                                                labels, registry=r), names)
        self.mirror(self.generation_tokens, Counter(vllm_names.GENERATION_TOKENS, "Output tokens received", labels,
                                                    registry=r), names)

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

