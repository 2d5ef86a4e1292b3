"""Free ports for servers bound long after the port is chosen."""

from __future__ import annotations

import socket

from cluster.net import free_port_outside_ephemeral


def test_ports_outside_the_ephemeral_range_are_free_and_below_it() -> None:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    with socket.socket() as held:  # a port some server holds is never handed out
        held.bind(("127.0.0.1", free_port_outside_ephemeral()))
        taken = held.getsockname()[1]
        for _ in range(50):
            port = free_port_outside_ephemeral()
            assert 20000 <= port < max(21000, low) and port != taken
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
