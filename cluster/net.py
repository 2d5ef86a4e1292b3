"""Small networking helpers shared by the launcher, the local Redis and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process may take it before the caller binds it; callers that can, retry on a bind
    failure (``start_redis`` does).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dial_host(host: str) -> str:
    """The address a local client dials for a server listening on ``host`` (wildcards -> loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
