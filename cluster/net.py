"""Small networking helpers shared by the launcher, the local Redis and the tests."""

from __future__ import annotations

from engine.net import free_port, free_port_outside_ephemeral

__all__ = ["dial_host", "free_port", "free_port_outside_ephemeral", "is_loopback"]


def dial_host(host: str) -> str:
    """The address a local client dials for a server listening on ``host`` (wildcards -> loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def is_loopback(host: str) -> bool:
    """Whether a server listening on ``host`` is reachable from this machine only."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
