"""A circuit breaker per node, and the prober that checks open (and, without a registry, all) nodes.

States: **closed** (routable), **open** (not routed to), **half-open** (routable again after a
passing probe; the next call's outcome closes or reopens it). A node opens at once when it refuses
a connection (UNAVAILABLE: dead, or stopping) and after ``failure_threshold`` consecutive failed
calls of other kinds (deadline exceeded, internal errors, decode streams that stall). A full node
(RESOURCE_EXHAUSTED) or a bad request is not a failure of the node.

``Prober`` asks each open node's standard health service (``grpc.health.v1``, which a node answers
SERVING from registration until it starts stopping), a round per ``probe_once`` (the app runs one
every ``--health-probe-s``): SERVING half-opens it. While
the registry is unreachable the proxy cannot see heartbeats, so the prober checks every known node:
health then comes from the nodes themselves. A node that answers NOT_SERVING or refuses the
connection opens at once; one that does not answer within the probe's timeout opens only after
``failure_threshold`` such rounds in a row (a busy host can be slow to answer one probe: the same
starvation that made the registry time out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's encoding
# A health probe's outcomes: the node answered SERVING, answered something else, refused the
# connection (UNAVAILABLE), or gave no answer in time (or failed otherwise).
SERVING, NOT_SERVING, REFUSED, NO_ANSWER = "serving", "not_serving", "refused", "no_answer"


@dataclass
class _Node:
    state: str = CLOSED
    failures: int = 0  # consecutive failed calls
    missed: int = 0  # consecutive probes without an answer


class Breakers:
    """The breakers of every node this proxy has called; ``on_change(node_id, state)`` on each move."""

    def __init__(self, failure_threshold: int = 3,
                 on_change: Callable[[str, str], None] = lambda node_id, state: None) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self._on_change = on_change
        self._nodes: dict[str, _Node] = {}

    def state(self, node_id: str) -> str:
        n = self._nodes.get(node_id)
        return n.state if n is not None else CLOSED

    def is_open(self, node_id: str) -> bool:
        n = self._nodes.get(node_id)
        return n is not None and n.state == OPEN

    def open_nodes(self) -> list[str]:
        return [k for k, n in self._nodes.items() if n.state == OPEN]

    def states(self) -> dict[str, str]:
        return {k: n.state for k, n in self._nodes.items()}

    def failure(self, node_id: str, *, refused: bool = False) -> None:
        """A call to the node failed (``refused``: it did not take the connection at all)."""
        n = self._nodes.setdefault(node_id, _Node())
        n.failures += 1
        if refused or n.state == HALF_OPEN or n.failures >= self.failure_threshold:
            self._move(node_id, n, OPEN, "refused a connection" if refused else f"{n.failures} failed calls in a row")

    def success(self, node_id: str) -> None:
        n = self._nodes.get(node_id)
        if n is None:
            return
        n.failures = n.missed = 0  # it answers: earlier missed probes are not "in a row" with later ones
        if n.state != CLOSED:
            self._move(node_id, n, CLOSED, "a call succeeded")

    def probe(self, node_id: str, outcome: str) -> None:
        """A health probe's outcome (``SERVING``, ``NOT_SERVING``, ``REFUSED`` or ``NO_ANSWER``): an
        open node that is serving half-opens; one that says it is not, or refuses, opens; one that
        does not answer opens after ``failure_threshold`` probes in a row without an answer."""
        if outcome not in (SERVING, NOT_SERVING, REFUSED, NO_ANSWER):
            raise ValueError(f"unknown probe outcome {outcome!r}")
        n = self._nodes.setdefault(node_id, _Node())
        n.missed = n.missed + 1 if outcome == NO_ANSWER else 0
        if outcome == SERVING:
            if n.state == OPEN:
                self._move(node_id, n, HALF_OPEN, "its health probe passed")
        elif outcome in (NOT_SERVING, REFUSED):
            self._move(node_id, n, OPEN, f"its health probe found it {outcome.replace('_', ' ')}")
        elif n.missed >= self.failure_threshold:
            self._move(node_id, n, OPEN, f"{n.missed} health probes in a row got no answer")

    def reset(self, node_id: str | None = None) -> None:
        """Close one node's breaker (or all): an operator says it is back."""
        for k in [node_id] if node_id is not None else list(self._nodes):
            n = self._nodes.get(k)
            if n is not None:
                n.failures = n.missed = 0
                if n.state != CLOSED:
                    self._move(k, n, CLOSED, "reset")

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the breakers of nodes no longer known (left the registry)."""
        known = set(keep)
        for k in [k for k in self._nodes if k not in known]:
            del self._nodes[k]

    def _move(self, node_id: str, n: _Node, state: str, why: str) -> None:
        if n.state == state:
            return
        log.warning("node %s: circuit %s -> %s (%s)", node_id, n.state, state, why)
        n.state = state
        if state == CLOSED:
            n.failures = n.missed = 0
        self._on_change(node_id, state)


async def check_health(channel: grpc.aio.Channel, timeout_s: float) -> str:
    """The node's answer within ``timeout_s``: ``SERVING``, ``NOT_SERVING``, ``REFUSED`` (it did
    not take the connection) or ``NO_ANSWER``."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        return REFUSED if e.code() == grpc.StatusCode.UNAVAILABLE else NO_ANSWER
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING


class Prober:
    """Probes the nodes' health, a round per ``probe_once`` (the app's lifespan runs one every ``health_probe_s``).

    ``nodes()`` is the node list as the registry last gave it; ``channel(address)`` a cached channel;
    ``stale()`` whether the registry is unreachable now (then every node is probed, not only open ones).
    """

    def __init__(self, breakers: Breakers, nodes: Callable[[], list], channel: Callable[[str], grpc.aio.Channel],
                 stale: Callable[[], bool], timeout_s: float = 1.0) -> None:
        self._breakers = breakers
        self._nodes = nodes
        self._channel = channel
        self._stale = stale
        self.timeout_s = timeout_s

    async def probe_once(self) -> None:
        nodes = self._nodes()
        self._breakers.forget(n.info.node_id for n in nodes)
        stale = self._stale()
        targets = [n for n in nodes if stale or self._breakers.is_open(n.info.node_id)]
        if not targets:
            return
        answers = await asyncio.gather(*(check_health(self._channel(n.info.address), self.timeout_s)
                                         for n in targets))
        for n, outcome in zip(targets, answers):
            self._breakers.probe(n.info.node_id, outcome)
