"""Mooncake Transfer Engine as a transport (``mooncake.engine.TransferEngine``).

One engine per rank, peer-to-peer handshake (no metadata server): the endpoint is
``"host:rpc_port"``. Batches are submitted asynchronously and polled against the timeout
(``get_batch_transfer_status``: 1 pending, 0 done, -1 failed). Measured facts this relies on
(mooncake-transfer-engine-non-cuda 0.3.13.post1): a submit to an unreachable peer returns batch id
0 (asking the status of id 0 crashes the process, so it is never asked); a read of memory the
peer did not register fails with -1. A batch that times out cannot be cancelled: its bytes may
still land later, so the caller must not reuse the destination blocks at once.

A failed batch is submitted again (``RETRIES`` times, within the timeout) before the read fails:
this engine's TCP lanes fail transfers for passing reasons (a lane whose idle socket the peer
closed fails its next transfer, then reconnects; a lane queue that stays full past the admission
timeout rejects slices), and copying the same bytes again is harmless. The lane limits get roomier
defaults than the engine's own (``cluster.envs.MOONCAKE_TCP_DEFAULTS``; the user's settings win).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from cluster import envs
from kv_transfer.layout import CacheLayout
from kv_transfer.transport import Segment, TransferError, Transport, register_cache

_PENDING, _DONE = 1, 0
# Measured limit of this engine (tcp, non-cuda 0.3.13.post1): with more than about 2,048 segments
# in flight at once (one batch or several), batches fail with status -1. So segments go in
# batches of MAX_BATCH with at most MAX_IN_FLIGHT segments outstanding.
MAX_BATCH = 512
MAX_IN_FLIGHT = 1024
RETRIES = 2  # further submissions of a failed batch
START_RETRIES = 2  # further submissions of a batch the engine could not start
START_PAUSE_S = 0.2  # before the first of them; doubled for each next one

log = logging.getLogger("pdcluster.transfer")


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(
            "Mooncake Transfer Engine is not importable: pip install 'mooncake-transfer-engine-non-cuda' "
            "(CPU) or 'mooncake-transfer-engine-cuda13' (GPU), and apt-get install libibverbs1 "
            f"({e})"
        ) from e
    return TransferEngine


class MooncakeTransport(Transport):
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        envs.set_mooncake_tcp_defaults()  # read by the engine's TCP transport as it starts
        if protocol == "nvlink_intra":  # without it the engine silently falls back to TCP (measured)
            os.environ["MC_INTRANODE_NVLINK"] = "1"
        self.protocol = protocol
        self._engine = _engine_class()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed with {rc}")
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, layout: CacheLayout) -> None:
        for r in layout.regions.values():
            rc = self._engine.register_memory(r.base, r.num_blocks * r.block_bytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake could not register layer {r.layer} ({rc})")
            self._registered.append(r.base)

    def _run(self, batches: dict[str, list[Segment]], timeout_s: float) -> None:
        """All peers' segments, MAX_BATCH per batch, at most MAX_IN_FLIGHT outstanding, within the
        timeout; a failed batch is submitted again up to RETRIES times."""
        submit = self._engine.batch_transfer_async_read
        todo = [(peer, segments[i : i + MAX_BATCH], 0) for peer, segments in batches.items()
                for i in range(0, len(segments), MAX_BATCH)]
        deadline = time.monotonic() + timeout_s
        pending: dict[int, tuple[str, list[Segment], int]] = {}  # batch id -> (peer, segments, retries so far)
        in_flight = 0
        pause = 5e-5
        starts = 0  # batches the engine could not start, so far
        while todo or pending:
            while todo and in_flight + len(todo[0][1]) <= MAX_IN_FLIGHT:  # a part is at most MAX_BATCH
                peer, part, tries = todo.pop(0)
                addrs = ([s.local_addr for s in part], [s.remote_addr for s in part], [s.nbytes for s in part])
                batch = submit(peer, *addrs)
                while not batch:
                    wait = START_PAUSE_S * 2**starts
                    if starts >= START_RETRIES or time.monotonic() + wait >= deadline:
                        raise TransferError("peer_gone", f"could not start a batch with {peer} "
                                                         f"({starts + 1} attempts)")
                    starts += 1
                    log.warning("could not start a batch with %s (its handshake failed?); trying again in %.1f s",
                                peer, wait)
                    time.sleep(wait)
                    batch = submit(peer, *addrs)
                pending[batch] = (peer, part, tries)
                in_flight += len(part)
            for batch, (peer, part, tries) in list(pending.items()):
                status = self._engine.get_batch_transfer_status([batch])
                if status == _PENDING:
                    continue
                del pending[batch]
                # A failed batch may still have slices in the engine, so a resubmission can briefly
                # put up to MAX_IN_FLIGHT + MAX_BATCH segments in flight: still under ~2,048.
                in_flight -= len(part)
                pause = 5e-5
                if status == _DONE:
                    continue
                if tries >= RETRIES:
                    raise TransferError("refused", f"{peer} failed a batch (status {status}, "
                                                   f"{tries + 1} attempts)")
                log.warning("a batch of %d segments with %s failed (status %s); submitting it again",
                            len(part), peer, status)
                todo.insert(0, (peer, part, tries + 1))
            if not pending and not todo:
                return
            if time.monotonic() >= deadline:
                peers = sorted({p for p, _, _ in pending.values()} | {p for p, _, _ in todo})
                raise TransferError("timeout", f"batches with {peers} not done after {timeout_s}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def read_all(self, batches: dict[str, list[Segment]], timeout_s: float) -> None:
        """Every peer's segments in flight together (the fan-in of one request), then waited for."""
        self._run(batches, timeout_s)

    def read(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        self._run({peer: segments}, timeout_s)

    def close(self) -> None:
        for base in self._registered:
            self._engine.unregister_memory(base)
        self._registered = []


class MooncakeExporter:
    """An ``engine.cache_export.CacheExporter``: registers a cache with its own Mooncake transport on
    ``host`` in the process that owns the cache (a rank process, or the node's), and answers its
    ``CacheLayout``. Picklable until ``export`` runs."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        self.host = host
        self.protocol = protocol
        self._transport: MooncakeTransport | None = None

    def export(self, layers: dict[int, Any]) -> CacheLayout:
        if self._transport is not None:
            raise RuntimeError("this exporter already registered a cache")
        self._transport = MooncakeTransport(host=self.host, protocol=self.protocol)
        try:
            return register_cache(self._transport, layers)
        except BaseException:  # nothing stays registered when a layer could not be
            self.close()
            raise

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
