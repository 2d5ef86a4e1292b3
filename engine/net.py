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
