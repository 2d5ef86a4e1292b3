"""The cluster token: every call between the cluster's processes carries it, and nodes refuse calls without it.

Anyone who can reach a node's gRPC port could otherwise Abort or Release other requests, or Decode
from a forged KV handle. With ``$PDCLUSTER_CLUSTER_TOKEN`` set (``pdctl up`` makes one per cluster;
compose passes its variable to every service), nodes answer UNAUTHENTICATED to a call whose metadata
does not carry it (``x-pdcluster-token``), and the proxy and the decode nodes send it. The standard
health service (``grpc.health.v1``) stays open: compose and Kubernetes probes call it without a
token, and it tells nothing but "serving". Unset, nothing is checked (a single-machine
development cluster on loopback).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from cluster import envs

METADATA_KEY = "x-pdcluster-token"
_OPEN_PREFIX = "/grpc.health.v1.Health/"


def call_metadata(token: str | None = None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call to a node carries (``token``, else ``$PDCLUSTER_CLUSTER_TOKEN``)."""
    token = token if token is not None else envs.cluster_token()
    return ((METADATA_KEY, token),) if token else None


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call but health checks that lacks the cluster token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the cluster token must not be empty")
        self._token = token.encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX) or self._carries_token(details):
            return handler
        return _refusal(handler)

    def _carries_token(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                # compare_digest: the time taken must not tell how much of a guess was right
                return hmac.compare_digest(given, self._token)
        return False


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token "
                        f"(metadata {METADATA_KEY}; the cluster's $PDCLUSTER_CLUSTER_TOKEN)")


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await _refuse(request, context)
    yield  # an async generator, as a server-streaming handler is


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(_refuse_stream, **kw)
