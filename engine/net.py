"""The one free-port helper (the engine's rendezvous, the launcher, the local Redis and tests use it)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process may take it before the caller binds it; callers that can, retry on a bind
    failure (``start_redis`` does).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_outside_ephemeral(host: str = "127.0.0.1", low: int = 20000) -> int:
    """A free TCP port below the kernel's ephemeral range (``ip_local_port_range``), for a server bound
    long after the port is chosen: no port-0 bind and no outgoing connection gets one of these, so only
    a process choosing ports the same way can take it in between (``free_port``'s ports were taken
    within the ~30 s before vLLM's engine core bound its side channel)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    high = max(low + 1000, ephemeral_low)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)
