"""Where the proxy learns about nodes: a ``NodeSource`` and the proxy's own view on top of it.

In production the source is the Redis registry (its cached ``RegistryView`` for reads, the
``Registry`` for drain flags: ``RegistrySource``, which ``proxy.workers`` wires); tests pass a
``StaticNodeSource``. ``NodeView`` adds what the registry cannot give at once: a drain flag set through this proxy
applies to the very next request, not after the next refresh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

from cluster.nodes import KVEvents, NodeFailure, NodeState
from proxy.routing.breaker import Breakers


class NodeSource(Protocol):
    """The nodes of the cluster as the registry knows them."""

    def snapshot(self) -> list[NodeState]:
        """The current list; must be cheap and never block (it is called on every request)."""
        ...

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Set a node's draining flag; False if the node is unknown. May block (it runs in a thread)."""
        ...

    def registry_error(self) -> str | None:
        """Why the registry is unreachable now (its view is stale), or None when it is fresh."""
        ...

    def kv_event_stream(self) -> KVEventFeed | None:
        """A fresh subscription to the nodes' KV events, or None when the source has none. May block."""
        ...

    def failures(self) -> list[NodeFailure]:
        """Nodes that stopped serving because their engine failed, lately, and why. May block."""
        ...


class KVEventFeed(Protocol):
    """A subscription to the nodes' KV events (``cluster.registry.KVEventStream``)."""

    def poll(self, timeout_s: float) -> list[KVEvents]:
        """The events that arrive within ``timeout_s`` (blocks that long at most)."""
        ...

    def close(self) -> None: ...


class RegistrySource:
    """The registry as a ``NodeSource``: reads from the cached view, drain flags through Redis."""

    def __init__(self, view: Any, registry: Any) -> None:
        self._view = view
        self._registry = registry

    def snapshot(self) -> list[NodeState]:
        return self._view.snapshot()

    def set_draining(self, node_id: str, draining: bool) -> bool:
        return self._registry.set_draining(node_id, draining)

    def registry_error(self) -> str | None:
        return self._view.last_error

    def kv_event_stream(self) -> Any:
        return self._registry.kv_event_stream()

    def failures(self) -> list[NodeFailure]:
        return self._registry.failures()


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

    def failures(self) -> list[NodeFailure]:
        return []

    def registry_error(self) -> str | None:
        return None

    def kv_event_stream(self) -> KVEventFeed | None:
        return None


class NodeView:
    """The source's snapshot with what this proxy knows better applied at once: the drain flags it
    set (before the next refresh) and its circuit breakers (``breaker.Breakers``: an open node is
    unhealthy here until a health probe passes).

    A local drain flag is kept until the source reports the same value (its refresh caught up) or
    ``hold_s`` passes (someone else changed the flag meanwhile: the registry wins).
    """

    def __init__(self, source: NodeSource, hold_s: float = 30.0, breakers: Breakers | None = None) -> None:
        self._source = source
        self._hold_s = hold_s
        self.breakers = breakers if breakers is not None else Breakers()
        self._overrides: dict[str, tuple[bool, float]] = {}  # node_id -> (draining, set at monotonic)

    def mark_unreachable(self, node_id: str) -> None:
        """A node refused a connection: its breaker opens, so requests stop going to a dead node
        before its heartbeat expires, until a health probe finds it serving."""
        self.breakers.failure(node_id, refused=True)

    def clear_unreachable(self, node_id: str | None = None) -> None:
        """Close breakers (of one node, or all): an operator says the node is back."""
        self.breakers.reset(node_id)

    def registry_error(self) -> str | None:
        """Why the registry is unreachable (the view is its last list), or None."""
        return self._source.registry_error()

    def registry_state(self) -> dict[str, str]:
        """``{"registry": "ok"}``, or ``"stale"`` with why: the proxy then routes on its last view of
        the registry, with node health from its own probes (``/health``, ``/admin/nodes``)."""
        error = self.registry_error()
        return {"registry": "ok"} if error is None else {"registry": "stale", "registry_error": error}

    def kv_event_stream(self) -> KVEventFeed | None:
        return self._source.kv_event_stream()

    async def failures(self) -> list[NodeFailure]:
        """The source's failed nodes (in a thread: a Redis round trip); none when it cannot be read."""
        try:
            return await asyncio.to_thread(self._source.failures)
        except Exception:  # the registry is away: /admin/nodes says so already (registry_state)
            return []

    def source_nodes(self) -> list[NodeState]:
        """The registry's list without this proxy's overlays (what the prober checks)."""
        return self._source.snapshot()

    def snapshot(self) -> list[NodeState]:
        nodes = self._source.snapshot()
        if not self._overrides and not self.breakers.open_nodes():
            return nodes
        now = time.monotonic()
        out = []
        for n in nodes:
            o = self._overrides.get(n.info.node_id)
            if o is not None and (n.draining == o[0] or now - o[1] > self._hold_s):
                del self._overrides[n.info.node_id]
                o = None
            if o is not None:
                n = replace(n, draining=o[0])
            if self.breakers.is_open(n.info.node_id):
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
