"""Prometheus series updated in batches, for the proxy's and the nodes' ``/metrics``.

A request path's counts and observations (``Tally.add`` and ``observe``) are tallied in dicts of plain
numbers and added to their series by ``flush`` (when a page is rendered). Each update straight into a
series takes its lock, and a labelled one finds its child first: in the proxy that was ~9% of a
worker's CPU per request (cProfile, docs/benchmarks.md). The tallies have a lock of their own, so the
thread that renders a page may flush while another adds.

A series may be *mirrored* into another (``mirror``): each update of the first is made to the second
too, under fixed labels. The proxy keeps its ``pdcluster_proxy_*`` families and feeds vLLM's names
from them this way.

Also the names and buckets of vLLM's request-level series, which the proxy and the nodes both expose.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Histogram

# vLLM's names (vllm/v1/metrics/loggers.py): dashboards, alerts and autoscalers built for vLLM read them.
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
QUEUE = "vllm:request_queue_time_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens"  # counters: exposed with "_total"
GENERATION_TOKENS = "vllm:generation_tokens"

# vLLM's default bounds, so quantiles compare with a vLLM server's; inter-token latency also below
# 10 ms, where a fast decode step lies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

Labels = tuple[str, ...]

if not hasattr(Histogram("layout_check", "", registry=None), "_upper_bounds"):  # observe() reads it
    raise RuntimeError("prometheus_client's Histogram has no _upper_bounds: update cluster.metrics.Tally")


class Tally:
    """Counts and observations held until ``flush`` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: dict[tuple[Counter, Labels], float] = {}
        self._observed: dict[tuple[Histogram, Labels], list[float]] = {}
        self._children: dict[tuple[Any, Labels], Any] = {}
        self._mirrors: dict[Any, tuple[Any, Labels]] = {}

    def mirror(self, source: Counter | Histogram, target: Counter | Histogram, labels: Labels = ()) -> None:
        """From now on, every ``add`` / ``observe`` of ``source`` (any labels) goes to ``target`` under
        ``labels`` too."""
        self._mirrors[source] = (target, labels)

    def add(self, counter: Counter, labels: Labels = (), amount: float = 1.0) -> None:
        """``counter.labels(*labels).inc(amount)``, at the next ``flush``."""
        with self._lock:
            self._add(counter, labels, amount)
            mirrored = self._mirrors.get(counter)
            if mirrored is not None:
                self._add(mirrored[0], mirrored[1], amount)

    def _add(self, counter: Counter, labels: Labels, amount: float) -> None:
        key = (counter, labels)
        self._added[key] = self._added.get(key, 0.0) + amount

    def observe(self, histogram: Histogram, value: float, labels: Labels = (), count: int = 1) -> None:
        """``count`` observations of ``value`` (``histogram.labels(*labels).observe``), at the next ``flush``."""
        if count <= 0:
            return
        with self._lock:
            self._observe(histogram, labels, value, count)
            mirrored = self._mirrors.get(histogram)
            if mirrored is not None:
                self._observe(mirrored[0], mirrored[1], value, count)

    def _observe(self, histogram: Histogram, labels: Labels, value: float, count: int) -> None:
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
        """Add the tallies to their series."""
        with self._lock:
            added, self._added = self._added, {}
            observed, self._observed = self._observed, {}
        for (counter, labels), amount in added.items():
            self._child(counter, labels).inc(amount)
        for (histogram, labels), tally in observed.items():
            child = self._child(histogram, labels)
            child._sum.inc(tally[0])
            for bucket, count in zip(child._buckets, tally[1:]):
                if count:
                    bucket.inc(count)

    def _child(self, metric: Any, labels: Labels) -> Any:
        child = self._children.get((metric, labels))
        if child is None:
            child = self._children[(metric, labels)] = metric.labels(*labels) if labels else metric
        return child
