"""The cluster's gRPC options (cluster/grpc_options.py) agree with one another."""

from __future__ import annotations

from cluster.grpc_options import CHANNEL_OPTIONS, MESSAGE_LIMITS, NO_PING_TIMEOUT_MS, SERVER_OPTIONS


def test_no_end_closes_a_connection_for_an_unanswered_ping_and_every_end_has_the_message_limits() -> None:
    server, channel = dict(SERVER_OPTIONS), dict(CHANNEL_OPTIONS)
    for options in (server, channel):
        assert options["grpc.http2.ping_timeout_ms"] == NO_PING_TIMEOUT_MS == 2**31 - 1
        assert set(MESSAGE_LIMITS) <= set(options.items())
    assert "grpc.keepalive_time_ms" not in channel  # keepalive pings off: the proxy's deadlines judge liveness
    # gRPC takes the first of two equal keys: none may be listed twice, or the later one would do nothing
    for options in (SERVER_OPTIONS, CHANNEL_OPTIONS):
        assert len({k for k, _ in options}) == len(options)
