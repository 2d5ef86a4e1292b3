"""A node's Prometheus ``/metrics``: vLLM's names where vLLM has the metric, ``pdcluster_*`` for the rest.

``serve`` starts prometheus_client's HTTP server on its own thread at ``NodeConfig.metrics_port`` (0: a
free port; -1: none) on the node's ``--host``, and the node publishes where it answers in the registry
(``NodeInfo.metrics_address``; ``pdctl status`` shows it). Every series carries ``model_name``, ``role``
and ``node`` labels; those of one DP replica carry ``replica`` (its dp rank) too.

Two kinds of series:

- **Request-level** (``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``, ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:prefix_cache_queries`` / ``_hits`` in tokens): observed by the
  node's gRPC service as each call runs, the same place for the native and the vLLM engine, tallied
  (``cluster.metrics.Tally``) and flushed when a page is rendered. On a prefill node a request's work
  ends with its first token: TTFT and end-to-end latency are the Prefill call's arrival to its answer,
  queue time the wait before its first prefill step, and it generates one token. On a decode node:
  TTFT is the Decode call's arrival to its first token made here (the KV pull included), queue time
  the arrival to admission (KV pulled, the request handed to the engine), inter-token latency the gap
  between tokens made here, end-to-end the arrival to the last token.
- **State** (``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``,
  ``vllm:num_preemptions``, leases held, KV transfer totals, the node's shape): read from the worker
  when a page is rendered, as the heartbeat reads its load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster import metrics as names
from cluster.metrics import Tally
from cluster.nodes import NodeInfo, ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb

LABELS = ("model_name", "role", "node")
REPLICA_LABELS = (*LABELS, "replica")


class MeteredWorker(Protocol):
    """What the state series read of a node's worker (``node_runtime.server.NodeWorker``)."""

    kv_protocol: str

    def load(self) -> list[ReplicaLoad]: ...

    def transfer_totals(self) -> pb.TransferTotals: ...


class NodeMetrics(Tally):
    """One node's series (module docstring); ``start`` serves them over HTTP."""

    def __init__(self, model_name: str, role: str, node_id: str) -> None:
        super().__init__()
        self.base = (model_name, role, node_id)
        self.registry = r = _FlushingRegistry(self.flush)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.ttft = Histogram(names.TTFT, "Call arrival to the first token made on this node", REPLICA_LABELS,
                              buckets=names.TTFT_BUCKETS, registry=r)
        self.itl = Histogram(names.ITL, "Time between output tokens (decode)", REPLICA_LABELS,
                             buckets=names.ITL_BUCKETS, registry=r)
        self.e2e = Histogram(names.E2E, "Call arrival to the request's last token on this node", REPLICA_LABELS,
                             buckets=names.REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(names.QUEUE, "Call arrival to the first prefill step (prefill) or to admission, "
                               "KV pulled (decode)", REPLICA_LABELS, buckets=names.REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens of requests served", REPLICA_LABELS,
                                     registry=r)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Tokens generated on this node", REPLICA_LABELS,
                                         registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      REPLICA_LABELS, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (prefill: "
                                   "not computed; decode: not pulled)", REPLICA_LABELS, registry=r)
        self._server: Any = None

    # -- the request path (the node's event loop) ----------------------------------------------
    def prefilled(self, arrival: float, prompt_tokens: int, reply: pb.PrefillResponse, queue_s: float | None) -> None:
        """A Prefill call answered: it arrived at ``arrival`` (``time.monotonic``); ``queue_s``: its wait
        before the first prefill step (None: not known)."""
        now = time.monotonic()
        labels = (*self.base, str(reply.dp_rank))
        self.observe(self.ttft, now - arrival, labels)
        self.observe(self.e2e, now - arrival, labels)
        if queue_s is not None:
            self.observe(self.queue, queue_s, labels)
        self.add(self.prompt_tokens, labels, prompt_tokens)
        self.add(self.generation_tokens, labels)
        self.add(self.prefix_queries, labels, prompt_tokens)
        self.add(self.prefix_hits, labels, reply.cached_tokens)

    def decode_call(self, prompt_tokens: int, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """``sink`` of a Decode call's items (``pb.DecodeEvent``s, then None at its end or the exception
        that failed it), observing them first."""
        return _DecodeCall(self, prompt_tokens, sink)

    # -- the page ------------------------------------------------------------------------------
    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` at ``host:port`` (0: a free port) on a thread; returns the port."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"cannot serve /metrics on {host}:{port} (--metrics-port): {e}") from e
        return int(self._server.server_port)

    def watch(self, worker: MeteredWorker, info: NodeInfo) -> None:
        """From now on each page has the state series, read from ``worker`` and ``info`` (the node's
        registry record)."""
        self.registry.register(_State(worker, info))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _FlushingRegistry(CollectorRegistry):
    """A registry that flushes the tallies before each page reads its series."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__()
        self._flush = flush

    def collect(self) -> Iterator[Any]:
        self._flush()
        yield from super().collect()


class _DecodeCall:
    """``NodeMetrics.decode_call``'s sink: the call's times and tokens, then its own sink."""

    __slots__ = ("m", "prompt", "sink", "arrival", "last", "labels")

    def __init__(self, m: NodeMetrics, prompt_tokens: int, sink: Callable[[Any], None]) -> None:
        self.m, self.prompt, self.sink = m, prompt_tokens, sink
        self.arrival = time.monotonic()
        self.last: float | None = None  # when the last tokens came
        self.labels: tuple[str, ...] | None = None  # known at admission

    def __call__(self, item: Any) -> None:
        m = self.m
        if isinstance(item, pb.DecodeEvent):
            kind = item.WhichOneof("event")
            if kind == "admitted":
                self.labels = labels = (*m.base, str(item.admitted.dp_rank))
                m.observe(m.queue, time.monotonic() - self.arrival, labels)
                m.add(m.prompt_tokens, labels, self.prompt)
                m.add(m.prefix_queries, labels, self.prompt)
                m.add(m.prefix_hits, labels, item.admitted.cached_tokens)
            elif kind == "tokens" and self.labels is not None and (k := len(item.tokens.tokens)):
                now = time.monotonic()
                if self.last is None:
                    m.observe(m.ttft, now - self.arrival, self.labels)
                else:  # tokens that came together share the gap
                    m.observe(m.itl, (now - self.last) / k, self.labels, count=k)
                self.last = now
                m.add(m.generation_tokens, self.labels, k)
        elif item is None and self.labels is not None:
            m.observe(m.e2e, time.monotonic() - self.arrival, self.labels)
        self.sink(item)


def _usage(r: ReplicaLoad) -> float:
    total = r.used_blocks + r.free_blocks
    return r.used_blocks / total if total else 0.0


# The series of each DP replica's load: (family, name, help, value; None: not known).
_PER_REPLICA: tuple[tuple[type, str, str, Callable[[ReplicaLoad], float | None]], ...] = (
    (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the engine's running batch", lambda r: r.running),
    (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to run (a decode node's: admitted, waiting "
     "to join)", lambda r: r.waiting),
    (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV cache usage: 1 means every block is in use (prefix-cached "
     "blocks count as free)", _usage),
    (CounterMetricFamily, "vllm:num_preemptions", "Running requests preempted for their blocks",
     lambda r: r.preemptions),
    (CounterMetricFamily, "vllm:spec_decode_num_drafts", "Speculative decoding: verify steps with drafts",
     lambda r: r.spec_drafts),
    (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens",
     lambda r: r.spec_draft_tokens),
    (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted",
     lambda r: r.spec_accepted_tokens),
    (GaugeMetricFamily, "pdcluster_queued_prefill_tokens", "Prompt tokens admitted, not computed yet",
     lambda r: r.queued_prefill_tokens),
    (GaugeMetricFamily, "pdcluster_prefix_cached_blocks", "KV blocks kept for a later prompt with the same prefix",
     lambda r: r.cached_blocks),
    (GaugeMetricFamily, "pdcluster_kv_leases_held", "Prefill: finished requests whose KV waits under a lease for "
     "the decode side", lambda r: r.held),
)


class _State(Collector):
    """The state series, read from the worker at each page (module docstring)."""

    def __init__(self, worker: MeteredWorker, info: NodeInfo) -> None:
        self.worker, self.info = worker, info

    def collect(self) -> Iterator[Any]:
        base = [self.info.model, self.info.role, self.info.node_id]
        loads = self.worker.load()
        for kind, name, doc, value in _PER_REPLICA:
            family = kind(name, doc, labels=REPLICA_LABELS)
            for r in loads:
                v = value(r)
                if v is not None:  # not known (a vLLM engine's preemptions), or off (speculative decoding)
                    family.add_metric([*base, str(r.dp_rank)], v)
            yield family
        yield from self._transfers(base)
        yield from self._shape(base)

    def _transfers(self, base: list[str]) -> Iterator[Any]:
        t = self.worker.transfer_totals()
        labels, values = [*LABELS, "protocol"], [*base, self.worker.kv_protocol]
        for name, doc, value in (
                ("pdcluster_kv_transfers", "KV pulls done (decode)", t.done),
                ("pdcluster_kv_transfer_bytes", "KV bytes pulled (decode)", t.bytes),
                ("pdcluster_kv_transfer_seconds", "Time spent in KV pulls (decode)", t.seconds),
                ("pdcluster_kv_leases_expired", "Prefill: held KV freed because its lease ran out", t.leases_expired)):
            yield _one(CounterMetricFamily, name, doc, labels, values, value)
        failures = CounterMetricFamily("pdcluster_kv_transfer_failures", "KV pulls that failed, by cause (decode)",
                                       labels=[*labels, "cause"])
        for cause, n in sorted(t.failures.items()):
            failures.add_metric([*values, cause], n)
        yield failures

    def _shape(self, base: list[str]) -> Iterator[Any]:
        i = self.info
        shape = {"engine": i.engine, "dp": str(i.dp), "pcp": str(i.pcp), "pp": str(i.pp), "ep": str(i.ep),
                 "kv_layout": i.kv_layout, "kv_cache_dtype": i.kv_cache_dtype, "kv_protocol": i.kv_protocol,
                 "weights": i.weights}
        yield _one(GaugeMetricFamily, "pdcluster_node_info", "The node's shape (always 1)", [*LABELS, *shape],
                   [*base, *shape.values()], 1)
        yield _one(GaugeMetricFamily, "pdcluster_experts_per_rank", "Routed experts each rank holds (all of them "
                   "without expert parallelism; 0: no MoE layers)", LABELS, base, i.experts_per_rank)
        yield _one(GaugeMetricFamily, "pdcluster_kv_cache_blocks", "KV blocks of one replica", LABELS, base,
                   i.num_blocks)


def _one(kind: type, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float) -> Any:
    """A family of one sample."""
    family = kind(name, doc, labels=labels)
    family.add_metric(list(values), value)
    return family
