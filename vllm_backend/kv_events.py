"""vLLM's KV events as ours: a ``--engine vllm`` node's prefix cache, in the proxy's block hashes.

With prefix caching on, the node's vLLM engine publishes its KV cache events (vLLM's
``kv_events_config``: ZMQ PUB on an ipc socket of the node's own, msgpack ``KVEventBatch``es of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``). ``VllmKVEvents`` subscribes, and turns
vLLM's block hashes into ours (``engine.block_hash``: the stored event carries each block's token ids
and its parent's hash, so ours chain the same way), keeping vLLM hash -> ours for the removals.
The node publishes them with its heartbeat like a native node's (``take``), so the proxy's prefix
index treats both engines alike. A stored block whose parent it never saw (an event lost before the
subscription joined) is skipped: a miss in the proxy's guess, nothing more.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Hashable, Iterable
from typing import Any

from engine.block_hash import block_hash
from engine.prefix_cache import split_events

log = logging.getLogger("pdcluster.vllm")

POLL_MS = 200  # the reader thread looks for stop() this often


def endpoint_for(node_id: str) -> str:
    """An ipc endpoint of this node's own (vLLM binds it; the node connects)."""
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'pdcluster-kv-events-{node_id}-{os.getpid()}')}"


class KVEventTranslator:
    """vLLM's events -> our stored and removed block hashes (net, since the last ``take``)."""

    def __init__(self) -> None:
        self._ours: dict[Hashable, int] = {}  # vLLM block hash -> our hash
        self._pending: dict[int, bool] = {}  # our hash -> stored (True) or removed
        self._lock = threading.Lock()

    def apply(self, events: Iterable[Any]) -> None:
        """Events of one ``KVEventBatch`` (vLLM's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``)."""
        with self._lock:
            for ev in events:
                kind = type(ev).__name__
                if kind == "BlockStored":
                    self._stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
                elif kind == "BlockRemoved":
                    for h in ev.block_hashes:
                        ours = self._ours.pop(h, None)
                        if ours is not None:
                            self._pending[ours] = False
                elif kind == "AllBlocksCleared":
                    for ours in self._ours.values():
                        self._pending[ours] = False
                    self._ours.clear()

    def _stored(self, hashes: list[Hashable], parent: Hashable | None, tokens: list[int], block_size: int) -> None:
        ours = None
        if parent is not None:
            ours = self._ours.get(parent)
            if ours is None:
                return  # its parent was never seen: no chain to hash from
        for i, h in enumerate(hashes):
            chunk = tokens[i * block_size:(i + 1) * block_size]
            if len(chunk) < block_size:
                return
            ours = block_hash(ours, chunk)
            self._ours[h] = ours
            self._pending[ours] = True

    def take(self) -> tuple[list[int], list[int]]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return split_events(pending)


class VllmKVEvents(threading.Thread):
    """Subscribes to the engine's KV events at ``endpoint`` and translates them as they come."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="vllm-kv-events", daemon=True)
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.translator = KVEventTranslator()
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._endpoint = endpoint
        self._stopping = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._socket.poll(POLL_MS):
                    continue
                frames = self._socket.recv_multipart()
                try:
                    batch = self._decode(frames[-1])  # (topic, sequence number, payload)
                except Exception as e:  # a message we cannot read: skip it, keep reading
                    log.warning("skipped a KV event batch: %s", e)
                    continue
                self.translator.apply(batch.events)
        except Exception as e:  # the socket closed under us at shutdown, or worse: no events from now on
            if not self._stopping.is_set():
                log.warning("KV events stopped: %s", e)

    def take(self) -> tuple[list[int], list[int]]:
        return self.translator.take()

    def close(self) -> None:
        self._stopping.set()
        self.join(timeout=2 * POLL_MS / 1000 + 1)
        self._socket.close()
        if self._endpoint.startswith("ipc://"):  # the engine bound it and is gone: its socket file stays
            with contextlib.suppress(OSError):
                os.unlink(self._endpoint.removeprefix("ipc://"))
