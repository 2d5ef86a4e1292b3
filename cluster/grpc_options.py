"""The gRPC options of the cluster's channels and servers, in one place: the proxy's channels to the nodes,
the decode side's channel to a prefill node (``Release``), and every node's server."""

from __future__ import annotations

# A KV handle of a long prompt on many ranks lists thousands of blocks per rank: leave room above gRPC's
# 4 MiB default, both ways, on every channel and server.
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_LIMITS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

# The proxy's channels to the nodes: notice a silently dead peer (no RST, e.g. a lost host) on long idle
# calls (a long prefill). Pings only while a call is open. A peer gets gRPC's default 20 s to answer: a
# host saturated for 10 s (CI's 2 cores under six engine processes) must not lose its decode streams,
# and a dead one is still noticed within 50 s, before the proxy's 60 s token timeout.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
)

# The nodes' servers accept those keepalive pings (every KEEPALIVE_TIME_MS) on calls that send nothing for
# a while (a long prefill), instead of answering them with GOAWAY "too_many_pings": the interval they allow
# must stay below the clients' ping time.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
