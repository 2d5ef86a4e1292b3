"""The vLLM connector's side channel (no vLLM import): one JSON request, one answer, and a port that a
restarted server binds again at once, without changing socketserver's class for the rest of the process."""

from __future__ import annotations

import socketserver
from typing import Any

import pytest

from vllm_backend.side_channel import SideChannelServer, call


def _echo(request: dict[str, Any]) -> dict[str, Any]:
    if request["op"] == "bad":
        raise KeyError("no such op")
    return {"echo": request}


def test_answers_and_binds_its_port_again_leaving_socketserver_alone() -> None:
    server = SideChannelServer("127.0.0.1", 0, _echo)
    try:
        assert call(server.address, {"op": "layout"}) == {"echo": {"op": "layout"}}
        with pytest.raises(ConnectionError, match="KeyError"):  # the handler's error is the answer
            call(server.address, {"op": "bad"})
    finally:
        server.close()
    again = SideChannelServer("127.0.0.1", server.port, lambda request: {})  # SO_REUSEADDR: the same port
    again.close()
    assert socketserver.ThreadingTCPServer.allow_reuse_address is False
    assert socketserver.TCPServer.allow_reuse_address is False
