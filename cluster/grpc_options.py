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
# calls (a long prefill). Pings only while a call is open. What closes a connection whose ping goes unanswered
# is gRPC core's ping timeout ("grpc.http2.ping_timeout_ms", the error "Stream removed (ping timeout)"), not
# the keepalive timeout: with grpcio 1.85 a stopped (SIGSTOP) server ends a client's stream ping_timeout_ms
# after the ping, with keepalive_timeout_ms far shorter never firing. gRPC's default for it is 60 s, and CI's
# 2 cores under a vLLM cluster (ten engine processes) have starved a node for ~2 minutes with its stream open:
# the node's streams must outlive that. A dead node is still noticed within KEEPALIVE_TIME_MS +
# PING_TIMEOUT_MS (150 s) on an open call; a request waiting for a token is bounded sooner by the proxy's own
# timeouts, and health probes (with deadlines of their own) take a silent node out of routing meanwhile.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000  # (gRPC's default; the ping timeout below is what closes the connection)
PING_TIMEOUT_MS = 120_000
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
)

# The nodes' servers accept those keepalive pings (every KEEPALIVE_TIME_MS) on calls that send nothing for
# a while (a long prefill), instead of answering them with GOAWAY "too_many_pings": the interval they allow
# must stay below the clients' ping time.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_LIMITS + (
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)
