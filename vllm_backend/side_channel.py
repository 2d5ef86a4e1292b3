"""The connector's side channel: one JSON request and one JSON answer per TCP connection.

vLLM's own P/D connectors exchange layouts over a side-channel port next to the engine (NIXL's
``VLLM_NIXL_SIDE_CHANNEL_PORT``, Mooncake's bootstrap port); ours does the same with a small
threaded TCP server, so the handshake needs nothing beyond ``remote_host``/``remote_port`` in
``kv_transfer_params``. Messages are one JSON object per line; a handler maps a request to an answer.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class WorkerInfo:
    """One worker's registered cache, as a producer's side channel serves it (``op: layout``)."""

    dp: int
    rank: int  # in its replica: ((pp · PCP) + pcp) · TP + tp
    endpoint: str  # Mooncake session "host:rpc_port"
    notify: str  # its notify server "host:port" (``op: done``)
    layout: dict[str, int]  # vllm_backend.layout.VllmKVLayout fields
    regions: dict[str, list[int]]  # layer -> [base, num_blocks, block_bytes]


Handler = Callable[[dict[str, Any]], dict[str, Any]]


class _Server(socketserver.ThreadingTCPServer):
    # SO_REUSEADDR: a restarted node binds its side-channel port again while the old one's connections
    # are still in TIME_WAIT. Set on this class, not on socketserver's: other servers keep their default.
    allow_reuse_address = True
    daemon_threads = True  # a connection's thread never holds the process open


class SideChannelServer:
    """Serves ``handler`` on ``host:port`` (port 0: a free one) from a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        class _Req(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline()
                try:
                    answer = handler(json.loads(line))
                except Exception as e:  # an answer, not a dead connection, for bad requests
                    answer = {"error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        self._server = _Server((host, port), _Req)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pd-side-channel", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def call(address: str, request: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one request to ``host:port`` and return the answer; raises ``ConnectionError`` on failure."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.sendall(json.dumps(request).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
    except OSError as e:
        raise ConnectionError(f"side channel {address}: {e}") from e
    answer = json.loads(buf)
    if "error" in answer:
        raise ConnectionError(f"side channel {address}: {answer['error']}")
    return answer
