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

# No connection of ours is closed for a ping left unanswered. gRPC sends pings of its own on every connection
# that receives data (flow control's BDP probes; keepalive pings too where they are on) and closes the
# connection, with every call on it, when one goes unanswered for "grpc.http2.ping_timeout_ms" (gRPC's
# default: 60 s; in grpcio 1.85 the keepalive timeout never fires, this is what does). A proxy's stream to a
# node carries all of that node's requests, so one unanswered ping failed them all: CI lost a vLLM decode
# stream to "ping timeout" with it at 20 s, at 60 s and (2026-12-06) at 120 s, the last within about two
# minutes of the proxy's start while the node answered the other tests' requests. Liveness is the proxy's
# own instead: every wait on a node has a deadline (prefill_timeout_s, token_timeout_s, the health probes'),
# and a node whose heartbeat stops leaves routing after its TTL. Keepalive pings stay off (gRPC's default).
NO_PING_TIMEOUT_MS = 2**31 - 1  # the largest gRPC takes (an int of milliseconds): about 24 days
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.http2.ping_timeout_ms", NO_PING_TIMEOUT_MS),
)

# The nodes' servers: the same for the pings they send (a server whose ping went unanswered closed the
# connection, and the proxy's calls on it failed with INTERNAL "Internal error from Core"). They accept a
# client's keepalive pings (a client of another make may send them) instead of answering GOAWAY
# "too_many_pings".
SERVER_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.http2.ping_timeout_ms", NO_PING_TIMEOUT_MS),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
