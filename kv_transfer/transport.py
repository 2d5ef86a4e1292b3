"""The transport interface: registered memory, and batches of byte copies to or from a peer.

A transport instance belongs to one process. It registers that process's cache regions, then reads
from registered memory of a peer named by its endpoint (the decode side pulls; nothing pushes).
Implementations: ``transports.fake`` (in-process, with fault injection, for tests) and
``transports.mooncake``. Every batch has a timeout; failures raise ``TransferError`` with a cause
for metrics. ``register_cache`` is how a node (or a rank, through ``engine.cache_export``) makes a
live cache readable.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kv_transfer.layout import CacheLayout, describe_cache

CAUSES = ("timeout", "peer_gone", "not_registered", "refused")


class TransferError(RuntimeError):
    def __init__(self, cause: str, detail: str) -> None:
        if cause not in CAUSES:
            raise ValueError(f"unknown transfer failure cause {cause!r}")
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail

    def __reduce__(self) -> tuple:  # picklable (a decode replica process sends it to its node)
        return (TransferError, (self.cause, self.detail))


@dataclass(frozen=True)
class Segment:
    """One contiguous copy: ``nbytes`` between a local and a remote address."""

    local_addr: int
    remote_addr: int
    nbytes: int


class Transport(ABC):
    endpoint: str

    @abstractmethod
    def register(self, layout: CacheLayout) -> None:
        """Make a cache's regions readable and writable by peers."""

    @abstractmethod
    def read(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        """Copy each remote range of ``peer`` into the local range; all or raise TransferError."""

    def read_all(self, batches: dict[str, list[Segment]], timeout_s: float) -> None:
        """Reads from several peers (one request's fan-in), all within ``timeout_s``.

        Transports that can have batches in flight together override this; here, one after another.
        """
        deadline = time.monotonic() + timeout_s
        for peer, segments in batches.items():
            self.read(peer, segments, max(0.0, deadline - time.monotonic()))

    @abstractmethod
    def close(self) -> None:
        """Unregister everything; peers see this endpoint as gone."""


def register_cache(transport: Transport, layers: dict[int, torch.Tensor]) -> CacheLayout:
    """Register a live cache (global layer index -> [num_blocks, block_size, L + R]) with
    ``transport``; returns its layout, which goes into KV handles."""
    layout = describe_cache(transport.endpoint, layers)
    transport.register(layout)
    return layout
