"""The cluster's gRPC options (cluster/grpc_options.py) agree with one another."""

from __future__ import annotations

from cluster.grpc_options import CHANNEL_OPTIONS, MESSAGE_LIMITS, SERVER_OPTIONS


def test_servers_accept_the_clients_pings_and_every_end_has_the_message_limits() -> None:
    server, channel = dict(SERVER_OPTIONS), dict(CHANNEL_OPTIONS)
    # a server that allowed pings less often than a client sends them would close its calls (too_many_pings)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= channel["grpc.keepalive_time_ms"]
    for options in (server, channel):
        assert set(MESSAGE_LIMITS) <= set(options.items())
