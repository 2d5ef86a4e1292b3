"""Where the proxy learns about nodes: a ``NodeSource`` and the proxy's own view on top of it.

In production the source is the Redis registry (its cached ``RegistryView`` for reads, the
``Registry`` for drain flags; ``proxy.__main__`` wires them); tests pass a ``StaticNodeSource``.
``NodeView`` adds what the registry cannot give at once: a drain flag set through this proxy
applies to the very next request, not after the next refresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol

from cluster.nodes import NodeState


class NodeSource(Protocol):
    """The nodes of the cluster as the registry knows them."""

    def snapshot(self) -> list[NodeState]:
        """The current list; must be cheap and never block (it is called on every request)."""
        ...

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Set a node's draining flag; False if the node is unknown. May block (it runs in a thread)."""
        ...


class StaticNodeSource:
    """A fixed set of nodes held in memory (tests, fixed topologies)."""

    def __init__(self, nodes: Iterable[NodeState] = ()) -> None:
        self._nodes = {n.info.node_id: n for n in nodes}

    def snapshot(self) -> list[NodeState]:
        return list(self._nodes.values())

    def set_draining(self, node_id: str, draining: bool) -> bool:
        if node_id not in self._nodes:
            return False
        self._nodes[node_id] = replace(self._nodes[node_id], draining=draining)
        return True

    def put(self, node: NodeState) -> None:
        """Add or replace a node (tests change load or health with it)."""
        self._nodes[node.info.node_id] = node

    def remove(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)


class NodeView:
    """The source's snapshot with the drain flags this proxy set applied at once.

    A local flag is kept until the source reports the same value (its refresh caught up) or
    ``hold_s`` passes (someone else changed the flag meanwhile: the registry wins).
    """

    def __init__(self, source: NodeSource, hold_s: float = 30.0, unreachable_s: float = 5.0) -> None:
        self._source = source
        self._hold_s = hold_s
        self._unreachable_s = unreachable_s
        self._overrides: dict[str, tuple[bool, float]] = {}  # node_id -> (draining, set at monotonic)
        self._down: dict[str, float] = {}  # node_id -> unhealthy here until (monotonic)

    def mark_unreachable(self, node_id: str) -> None:
        """A node refused a connection: treat it as unhealthy for ``unreachable_s`` (about the
        registry's TTL, after which the registry knows whether it is really gone), so requests
        stop going to a dead node before its heartbeat expires."""
        self._down[node_id] = time.monotonic() + self._unreachable_s

    def clear_unreachable(self, node_id: str | None = None) -> None:
        """Forget unreachable marks (of one node, or all): an operator says the node is back."""
        if node_id is None:
            self._down.clear()
        else:
            self._down.pop(node_id, None)

    def snapshot(self) -> list[NodeState]:
        nodes = self._source.snapshot()
        if not self._overrides and not self._down:
            return nodes
        now = time.monotonic()
        for node_id, until in list(self._down.items()):
            if until <= now:
                del self._down[node_id]
        out = []
        for n in nodes:
            o = self._overrides.get(n.info.node_id)
            if o is not None and (n.draining == o[0] or now - o[1] > self._hold_s):
                del self._overrides[n.info.node_id]
                o = None
            if o is not None:
                n = replace(n, draining=o[0])
            if n.info.node_id in self._down:
                n = replace(n, healthy=False)
            out.append(n)
        return out

    def find(self, node_id: str) -> NodeState | None:
        return next((n for n in self.snapshot() if n.info.node_id == node_id), None)

    async def set_draining(self, node_id: str, draining: bool) -> bool:
        """Write the flag through the source (in a thread: it may be a Redis round trip), then apply it here."""
        found = await asyncio.to_thread(self._source.set_draining, node_id, draining)
        if found:
            self._overrides[node_id] = (draining, time.monotonic())
            if not draining:
                self.clear_unreachable(node_id)
        return found


def available(nodes: Iterable[NodeState], model: str, role: str | None = None) -> list[NodeState]:
    """Healthy, non-draining nodes of ``model`` (and ``role``): the ones that may take new requests."""
    return [
        n for n in nodes
        if n.healthy and not n.draining and n.info.model == model and (role is None or n.info.role == role)
    ]


def context_limit(nodes: Iterable[NodeState], model: str, fallback: int) -> int:
    """The longest prompt + output the cluster can take: the smallest ``max_model_len`` of the nodes
    that may serve ``model`` (a request may land on any of them), else the model's own limit."""
    lens = [n.info.max_model_len for n in available(nodes, model)]
    return min(lens) if lens else fallback
