"""The transport interface: registered memory, and batches of byte copies to or from a peer.

A transport instance belongs to one rank. It registers the rank's cache regions, then reads from
(or writes to) registered memory of a peer named by its endpoint. Implementations:
``transports.fake`` (in-process, with fault injection, for tests) and Mooncake Transfer Engine
(next). Every batch has a timeout; failures raise ``TransferError`` with a cause for metrics.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kv_transfer.layout import CacheLayout

CAUSES = ("timeout", "peer_gone", "not_registered", "refused")


class TransferError(RuntimeError):
    def __init__(self, cause: str, detail: str) -> None:
        if cause not in CAUSES:
            raise ValueError(f"unknown transfer failure cause {cause!r}")
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


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

    @abstractmethod
    def write(self, peer: str, segments: list[Segment], timeout_s: float) -> None:
        """Copy each local range into the remote range of ``peer``; all or raise TransferError."""

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
