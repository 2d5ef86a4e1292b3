"""Calls to a node as the proxy makes them: over the node's multiplexed stream (``PrefillMux``), with the
proxy's own client half (``proxy.link.mux_client``), from synchronous tests."""

from __future__ import annotations

import asyncio

import grpc

from cluster.mux_wire import PREFILL
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from proxy.link.mux_client import MuxStream, prefill


def mux_prefill(address: str, request: pb.PrefillRequest, timeout_s: float = 60.0) -> pb.PrefillResponse:
    """``Prefill`` over a new multiplexed stream to ``address``; a refused call raises the node's status
    (``grpc.aio.AioRpcError``, a ``grpc.RpcError``)."""

    async def call() -> pb.PrefillResponse:
        channel = grpc.aio.insecure_channel(address)
        stream = MuxStream(channel, PREFILL)
        try:
            return await prefill(stream, request, timeout_s)
        finally:
            stream.close()
            await channel.close()

    return asyncio.run(call())
