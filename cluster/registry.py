"""The Redis registry: nodes publish who they are and their load; the proxy keeps a cached view.

Lifecycle of a node: ``heartbeat()`` every ``heartbeat_s`` (the first one registers it, so a
node re-registers by itself after a Redis restart) ... ``deregister()`` on a clean shutdown. A
node that dies without deregistering disappears when its record's TTL runs out. The admin sets and
clears draining flags with ``set_draining()``; nodes read theirs back from ``heartbeat()``.

Key layout, all under ``<cluster>:`` so that clusters can share one Redis:

- ``<cluster>:node:<node_id>``: the node's JSON record (info, replica loads, heartbeat time),
  rewritten by every heartbeat with a TTL of ``ttl_s``.
- ``<cluster>:nodes``: the set of node ids, so reads need no SCAN over a shared Redis; ids whose
  record has expired are pruned by readers.
- ``<cluster>:draining``: the set of draining node ids. Kept apart from the record so heartbeats
  do not overwrite it; ``deregister()`` clears it. A node that crashes keeps its flag, so a drained
  node restarted by a supervisor comes back still draining; a Redis that restarts empty gets the
  flags back from the draining nodes' next heartbeats (each remembers the flag it last heard).
- ``<cluster>:events``: pub/sub channel; a message whenever a node joins or leaves or a draining
  flag changes, so watchers refresh at once instead of at their next poll.
- ``<cluster>:failed:<node_id>``: why a node whose engine failed stopped serving (``NodeFailure`` as
  JSON), written as it leaves, kept ``FAILURE_TTL_S``, and cleared when a node of that id registers again;
  ``<cluster>:failed`` indexes them as ``nodes`` does the records.
- ``<cluster>:kv_events``: pub/sub channel; each heartbeat, a message per replica whose prefix
  cache changed (``KVEvents`` as JSON: block hashes stored and evicted), for the proxy's prefix
  index. Fire and forget: a reader that misses one guesses worse, nothing breaks.

Health is judged on Redis' clock (the record's remaining TTL), never by comparing the clocks of
two machines; ``NodeState.heartbeat_at`` is translated to the reader's clock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from urllib.parse import urlsplit, urlunsplit

import redis

from cluster.config import RegistryConfig
from cluster.nodes import KVEvents, NodeFailure, NodeInfo, NodeState, ReplicaLoad

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 2.0  # the longest any one Redis round trip may take (capped at the TTL)
_STOP_POLL_S = 0.2  # how often the view's thread checks for stop() while waiting for notifications
FAILURE_TTL_S = 3600.0  # how long a failed node's reason stays for `pdctl status`

# Set or clear a draining flag only if the node is registered, atomically: a check-then-set from
# Python could leave a flag behind for a node that deregistered in between.
_SET_DRAINING = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] == '1' then redis.call('SADD', KEYS[2], ARGV[1]) else redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""
# Drop an id from the index only if its record is still gone: it may have re-registered meanwhile.
_PRUNE = """
local n = 0
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then n = n + redis.call('SREM', KEYS[1], id) end
end
return n
"""


class RegistryError(RuntimeError):
    """Redis could not be reached or answered with an error."""


class Registry:
    """Nodes' records in Redis: written by the nodes' heartbeats, read by the proxy and ``pdctl``."""

    def __init__(self, config: RegistryConfig, client: redis.Redis | None = None) -> None:
        self.config = config
        timeout_s = min(SOCKET_TIMEOUT_S, config.ttl_s)
        self._owns_client = client is None
        self._client = client or redis.Redis.from_url(
            config.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self._prefix = f"{config.cluster}:"
        self._index_key = f"{self._prefix}nodes"
        self._draining_key = f"{self._prefix}draining"
        self._failed_key = f"{self._prefix}failed"
        self.channel = f"{self._prefix}events"
        self.kv_channel = f"{self._prefix}kv_events"
        self._set_draining_script = self._client.register_script(_SET_DRAINING)
        self._prune_script = self._client.register_script(_PRUNE)

    def heartbeat(self, info: NodeInfo, replicas: Sequence[ReplicaLoad], was_draining: bool = False) -> bool:
        """Write the node's record with a fresh TTL; returns whether the node is draining.

        ``was_draining``: what the node last heard. When its record is gone (Redis restarted without
        persistence, or it expired in an outage) a draining node sets its flag again, so a registry
        restart does not undrain the cluster."""
        record = json.dumps({
            "info": info.to_dict(),
            "replicas": [asdict(r) for r in replicas],
            "heartbeat_at": time.time(),
            "ttl_s": self.config.ttl_s,  # readers derive the age from the TTL left on this one
        })
        key = self._node_key(info.node_id)
        with self._errors("heartbeat"):
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(key)
            pipe.set(key, record, px=_ms(self.config.ttl_s))
            pipe.sadd(self._index_key, info.node_id)
            pipe.sismember(self._draining_key, info.node_id)
            existed, _, _, draining = pipe.execute()
            if not existed:  # first heartbeat, or back after its record expired or Redis restarted
                self._client.delete(self._failure_key(info.node_id))  # serving again: an old failure is past
                self._client.srem(self._failed_key, info.node_id)
                if was_draining and not draining:
                    self._client.sadd(self._draining_key, info.node_id)
                    draining = True
                self._notify("join", info.node_id)
        return bool(draining)

    def publish_kv_events(self, events: Sequence[KVEvents]) -> None:
        """Publish replicas' prefix-cache changes (one message each; empty ones are skipped)."""
        events = [e for e in events if e.stored or e.removed]
        if not events:
            return
        with self._errors("publish KV events"):
            pipe = self._client.pipeline(transaction=False)
            for e in events:
                pipe.publish(self.kv_channel, json.dumps(e.to_dict()))
            pipe.execute()

    def kv_event_stream(self) -> KVEventStream:
        """A subscription to the cluster's KV events (its own Redis connection)."""
        with self._errors("subscribe to KV events"):
            return KVEventStream(self._client.pubsub(ignore_subscribe_messages=True), self.kv_channel)

    def deregister(self, node_id: str) -> None:
        """Remove the node and its draining flag (a clean shutdown)."""
        with self._errors("deregister"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._node_key(node_id))
            pipe.srem(self._index_key, node_id)
            pipe.srem(self._draining_key, node_id)
            pipe.execute()
            self._notify("leave", node_id)

    def record_failure(self, failure: NodeFailure) -> None:
        """Keep why ``failure.node_id`` stopped serving (it deregisters next), for ``FAILURE_TTL_S``."""
        with self._errors("record a failure"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self._failure_key(failure.node_id), json.dumps(failure.to_dict()), px=_ms(FAILURE_TTL_S))
            pipe.sadd(self._failed_key, failure.node_id)
            pipe.execute()

    def failures(self) -> list[NodeFailure]:
        """The nodes that failed within ``FAILURE_TTL_S`` and have not registered again, newest first."""
        with self._errors("read failures"):
            ids = sorted(_text(i) for i in self._client.smembers(self._failed_key))
            records = self._client.mget([self._failure_key(i) for i in ids]) if ids else []
            out, gone = [], []
            for node_id, record in zip(ids, records):
                if record is None:
                    gone.append(node_id)
                    continue
                try:
                    out.append(NodeFailure.from_dict(json.loads(record)))
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("ignoring a malformed failure record of %s: %s", node_id, e)
            if gone:
                self._prune_script(keys=[self._failed_key, *map(self._failure_key, gone)], args=gone)
        return sorted(out, key=lambda f: -f.at)

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Set or clear the node's draining flag; False if no such node is registered."""
        with self._errors("set draining"):
            found = self._set_draining_script(
                keys=[self._node_key(node_id), self._draining_key], args=[node_id, "1" if draining else "0"]
            )
            if found:
                self._notify("drain" if draining else "undrain", node_id)
        return bool(found)

    def nodes(self) -> list[NodeState]:
        """Every live node, sorted by (role, node_id)."""
        with self._errors("read nodes"):
            pipe = self._client.pipeline(transaction=False)
            pipe.smembers(self._index_key)
            pipe.smembers(self._draining_key)
            ids, draining = pipe.execute()
            ids = sorted(_text(i) for i in ids)
            draining = {_text(i) for i in draining}
            pipe = self._client.pipeline(transaction=True)  # records and TTLs of one moment
            for node_id in ids:
                pipe.get(self._node_key(node_id))
                pipe.pttl(self._node_key(node_id))
            values = pipe.execute()
            now = time.time()
            states, gone = [], []
            for node_id, record, pttl_ms in zip(ids, values[0::2], values[1::2]):
                if record is None:
                    gone.append(node_id)
                    continue
                state = self._parse(node_id, record, pttl_ms, node_id in draining, now)
                if state is not None:
                    states.append(state)
            if gone:
                self._prune_script(keys=[self._index_key, *map(self._node_key, gone)], args=gone)
        return sorted(states, key=lambda s: (s.info.role, s.info.node_id))

    def watch(self) -> Watch:
        """A subscription to this cluster's change notifications."""
        with self._errors("subscribe"):
            return Watch(self._client.pubsub(ignore_subscribe_messages=True), self.channel)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def _parse(self, node_id: str, record: str | bytes, pttl_ms: int, draining: bool, now: float) -> NodeState | None:
        try:
            d = json.loads(record)
            info = NodeInfo.from_dict(d["info"])
            replicas = tuple(ReplicaLoad.from_dict(r) for r in d["replicas"])
            written_ttl_s = float(d.get("ttl_s", self.config.ttl_s))
        except (ValueError, KeyError, TypeError) as e:
            # One bad record (another version, a hand edit) must not hide every other node.
            log.warning("registry: skipping malformed record of %s: %s", node_id, e)
            return None
        age_s = max(0.0, written_ttl_s - pttl_ms / 1000) if pttl_ms >= 0 else 0.0
        return NodeState(info=info, replicas=replicas, draining=draining, heartbeat_at=now - age_s,
                         healthy=age_s <= written_ttl_s, ttl_s=written_ttl_s)

    def _node_key(self, node_id: str) -> str:
        return f"{self._prefix}node:{node_id}"

    def _failure_key(self, node_id: str) -> str:
        return f"{self._prefix}failed:{node_id}"

    def _notify(self, event: str, node_id: str) -> None:
        self._client.publish(self.channel, json.dumps({"event": event, "node_id": node_id}))

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as e:
            raise RegistryError(f"registry {_redact(self.config.url)}: {action} failed: {e}") from e


class Watch:
    """A subscription to a cluster's change notifications (one Redis connection)."""

    def __init__(self, pubsub: redis.client.PubSub, channel: str) -> None:
        self._pubsub = pubsub
        self._pubsub.subscribe(channel)

    def wait(self, timeout_s: float) -> bool:
        """True when a notification arrived within ``timeout_s`` (pending ones are consumed too)."""
        try:
            if self._pubsub.get_message(timeout=max(0.0, timeout_s)) is None:
                return False
            while self._pubsub.get_message(timeout=0) is not None:
                pass  # a burst of changes needs one refresh, not one each
            return True
        except redis.RedisError as e:
            raise RegistryError(f"registry notifications: {e}") from e

    def close(self) -> None:
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass  # the connection is already gone


class KVEventStream:
    """The cluster's KV events as they are published (``Registry.kv_event_stream``)."""

    def __init__(self, pubsub: redis.client.PubSub, channel: str) -> None:
        self._pubsub = pubsub
        self._pubsub.subscribe(channel)

    def poll(self, timeout_s: float, limit: int = 1024) -> list[KVEvents]:
        """The messages that arrive within ``timeout_s`` (at most ``limit``; pending ones at once).
        Malformed messages are skipped."""
        out: list[KVEvents] = []
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            while len(out) < limit:
                # None: nothing in time, or a subscription notice (skipped): wait on while time is left
                left = deadline - time.monotonic() if not out else 0.0
                msg = self._pubsub.get_message(timeout=max(0.0, left))
                if msg is None:
                    if out or time.monotonic() >= deadline:
                        break
                    continue
                try:
                    out.append(KVEvents.from_dict(json.loads(msg["data"])))
                except (ValueError, KeyError, TypeError):
                    log.warning("skipped a malformed KV event message")
        except redis.RedisError as e:
            raise RegistryError(f"KV events: {e}") from e
        return out

    def close(self) -> None:
        try:
            self._pubsub.close()
        except redis.RedisError:
            pass  # the connection is already gone


RETRY_MAX_S = 4.0  # the longest a view waits between two attempts to reach an unreachable Redis


class RegistryView:
    """The proxy's cached view: no Redis round trip per request.

    A daemon thread refreshes the list every ``refresh_s`` and at once on a change notification.
    While Redis is unreachable the last list is kept (``last_error`` says why) and its nodes turn
    unhealthy as their last heartbeat grows older than the TTL.
    """

    def __init__(self, registry: Registry, refresh_s: float = 0.5) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._registry = registry
        self._refresh_s = refresh_s
        self._last_error: str | None = None
        # The last list Redis gave, with its moment on the wall clock (time.time(), the frame of its
        # heartbeat times) and on the monotonic one: replaced as one, snapshot() reads it unlocked.
        self._published: tuple[list[NodeState], float, float] = ([], 0.0, 0.0)
        self._held: dict[str, NodeState] = {}  # known before an outage, not re-registered yet
        self._held_until = 0.0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take a first snapshot (so a just-started proxy can route) and start the refresh thread."""
        if self._thread is not None:
            raise RuntimeError("RegistryView already started")
        self._try_refresh()
        self._thread = threading.Thread(target=self._run, name=f"registry-view-{self._registry.config.cluster}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # At worst one Redis round trip (a refresh) and one wait slice are in progress.
            self._thread.join(timeout=2 * SOCKET_TIMEOUT_S + _STOP_POLL_S + 1.0)

    def snapshot(self) -> list[NodeState]:
        """The last refreshed list; nodes whose last heartbeat is older than the TTL are unhealthy.

        While Redis is unreachable no heartbeat can arrive, so the TTL counts to the last refresh
        instead of now: the nodes healthy then stay so (their own health probes are the proxy's
        business, ``proxy.routing.breaker``), rather than all turning unhealthy after the TTL. When Redis
        is back (perhaps restarted, empty), those nodes stay for one TTL while they re-register.
        """
        nodes, now, refreshed_mono = self._published
        # The nodes' heartbeat times are of the refresh's wall clock; the time since is counted on the
        # monotonic clock, so a stepped wall clock (NTP, a VM resumed) does not age every node at once.
        if self._last_error is None:
            now += time.monotonic() - refreshed_mono
        ttl_s = self._registry.config.ttl_s
        return [replace(n, healthy=False) if n.healthy and now - n.heartbeat_at > (n.ttl_s or ttl_s) else n
                for n in nodes]

    def wait_for(self, predicate: Callable[[list[NodeState]], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(snapshot())`` holds; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate(self.snapshot()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Wake at least every refresh_s: health also changes with time, without a refresh.
                self._changed.wait(min(remaining, self._refresh_s))
        return True

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def _run(self) -> None:
        watch: Watch | None = None
        failures = 0  # in a row: the retries back off, up to RETRY_MAX_S
        while not self._stop.is_set():
            try:
                if watch is None:
                    watch = self._registry.watch()
                    self._refresh()  # changes made while we were not subscribed
                    failures = 0
                deadline = time.monotonic() + self._refresh_s
                while not self._stop.is_set() and time.monotonic() < deadline:
                    # Wait in short slices so that stop() returns promptly whatever refresh_s is.
                    if watch.wait(min(deadline - time.monotonic(), _STOP_POLL_S)):
                        break
                if not self._stop.is_set():
                    self._refresh()
            except Exception as e:  # this thread must outlive any error; it records it instead
                self._record_error(e)
                if watch is not None:
                    watch.close()
                    watch = None
                failures += 1
                # retry without spinning while Redis is away, and without every proxy hammering it as it restarts
                self._stop.wait(min(self._refresh_s * 2 ** (failures - 1), RETRY_MAX_S))
        if watch is not None:
            watch.close()

    def _try_refresh(self) -> None:
        try:
            self._refresh()
        except RegistryError as e:
            self._record_error(e)

    def _refresh(self) -> None:
        nodes = self._registry.nodes()
        now, now_mono = time.time(), time.monotonic()
        with self._changed:
            if self._last_error is not None and self._published[0]:
                # Back after an outage: a restarted Redis is empty until each node's next heartbeat.
                # Keep the nodes we knew for one TTL (as alive now: they were while the proxy probed
                # them) unless they re-register or their TTL runs out first.
                self._held = {n.info.node_id: replace(n, heartbeat_at=now) for n in self.snapshot() if n.healthy}
                self._held_until = now + self._registry.config.ttl_s
            if self._held and now < self._held_until:
                fresh = {n.info.node_id for n in nodes}
                nodes = nodes + [n for k, n in self._held.items() if k not in fresh]
            else:
                self._held = {}
            self._published = (nodes, now, now_mono)
            self._last_error = None
            self._changed.notify_all()

    def _record_error(self, e: Exception) -> None:
        if not isinstance(e, RegistryError):
            log.exception("registry view: unexpected error")
        with self._changed:
            self._last_error = str(e)
            self._changed.notify_all()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))

