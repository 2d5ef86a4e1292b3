"""gRPC clients of the nodes: one ``grpc.aio`` channel per node address, created on first use, and on
it one multiplexed stream per service that every request's call goes over (``proxy.link.mux_client``).

Channels are bound to the event loop that creates them, so they are made lazily from within the
app's loop and closed on shutdown.
"""

from __future__ import annotations

import logging

import grpc

from cluster import tls
from cluster.auth import call_metadata
from cluster.grpc_options import CHANNEL_OPTIONS
from cluster.mux_wire import DECODE, PREFILL
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from proxy.link.mux_client import MuxStream

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0

class NodeClients:
    """The nodes' multiplexed streams and the prefill service's stub, over cached channels."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[tuple[str, str], MuxStream] = {}  # (role, address) -> its multiplexed stream
        self.metadata = call_metadata()  # the cluster token, on every call to a node (cluster.auth)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = tls.aio_channel(address, options=CHANNEL_OPTIONS)  # TLS when configured
        return ch

    def prefill(self, address: str) -> pb_grpc.PrefillServiceStub:
        return pb_grpc.PrefillServiceStub(self.channel(address))

    def prefill_stream(self, address: str) -> MuxStream:
        """The node's ``PrefillMux`` stream (a new one when there is none, or it broke)."""
        stream = self._streams.get(("prefill", address))
        if stream is None or stream.broken:
            stream = self._streams["prefill", address] = MuxStream(self.channel(address), PREFILL, self.metadata)
        return stream

    def decode_stream(self, address: str) -> MuxStream:
        """The node's ``DecodeMux`` stream (a new one when there is none, or it broke)."""
        stream = self._streams.get(("decode", address))
        if stream is None or stream.broken:
            stream = self._streams["decode", address] = MuxStream(self.channel(address), DECODE, self.metadata)
        return stream

    async def abort_prefill(self, address: str, request_id: str) -> bool:
        """Free whatever the prefill node holds for the request; never raises (the caller is cleaning up)."""
        try:
            reply = await self.prefill(address).Abort(pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S,
                                                      metadata=self.metadata)
            return reply.found
        except grpc.aio.AioRpcError as e:
            # The lease on the prefill node frees the blocks anyway; nothing more to do.
            log.warning("abort of %s on prefill %s failed: %s", request_id, address, e.code().name)
            return False

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()
