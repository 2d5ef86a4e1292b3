"""The decode side's confirmation to the prefill node: ``PrefillService.Release`` after a pull.

The answer is authoritative: ``found=False`` means the prefill node no longer held the blocks (its
lease ran out, or the request was aborted), so they may have been reused while they were read and
the pulled KV cannot be trusted. An unreachable prefill node cannot have reused anything after the
pull completed, so that counts as confirmed (with a warning).
"""

from __future__ import annotations

import logging
import threading

import grpc

from cluster import envs, tls
from cluster.auth import call_metadata
from cluster.grpc_options import CHANNEL_OPTIONS
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc

log = logging.getLogger("pdcluster.decode")
TIMEOUT_S = 5.0
MAX_CHANNELS = 64  # prefill nodes restarted on new ports leave old addresses behind


class PrefillConfirmer:
    """Blocking Release calls (from the pull threads), one cached channel per prefill node."""

    def __init__(self) -> None:
        self._metadata = call_metadata()
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, pb_grpc.PrefillServiceStub]] = {}

    def __call__(self, address: str, request_id: str) -> bool:
        with self._lock:
            entry = self._channels.get(address)
            if entry is None:
                if len(self._channels) >= MAX_CHANNELS:  # drop the oldest
                    old = next(iter(self._channels))
                    self._channels.pop(old)[0].close()
                channel = tls.channel(address, options=CHANNEL_OPTIONS)
                entry = self._channels[address] = (channel, pb_grpc.PrefillServiceStub(channel))
        try:
            return entry[1].Release(pb.ReleaseRequest(request_id=request_id), timeout=TIMEOUT_S,
                                    metadata=self._metadata).found
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # the blocks stay held there until its lease ends
                log.error("the prefill node at %s refused our cluster token: check $%s on both", address,
                          envs.CLUSTER_TOKEN)
            log.warning("could not confirm %s to %s (%s); the pull completed, so its KV is used", request_id,
                        address, e.code())
            return True

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()
