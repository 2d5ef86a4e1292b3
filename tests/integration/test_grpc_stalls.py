"""A stalled peer does not break the cluster's gRPC connections (cluster/grpc_options.py).

A server process (our server options) echoes a bidirectional stream that a client (the proxy's channel
options) keeps writing to. The client also sends keepalive pings every 0.5 s here, so that a ping is surely
in flight while the server is stopped (SIGSTOP, as CI's VMs and a busy host stop a node) for 3 s; then the
server is continued. The stream must go on. The same run with a 1 s ping timeout (gRPC's own default is
60 s) breaks it, so the check can fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from cluster.grpc_options import CHANNEL_OPTIONS, MESSAGE_LIMITS, SERVER_OPTIONS

STALL_S = 3.0
PINGING = (("grpc.keepalive_time_ms", 500),)  # a ping in flight through the stall
SHORT_PING_TIMEOUT = (("grpc.http2.ping_timeout_ms", 1000),)
SERVICE, METHOD = "stall.Echo", "Bidi"

SERVER = f"""
import ast, asyncio, sys
import grpc

async def main() -> None:
    async def bidi(requests, context):
        async for m in requests:
            yield m
    methods = {{{METHOD!r}: grpc.stream_stream_rpc_method_handler(bidi)}}
    handler = grpc.method_handlers_generic_handler({SERVICE!r}, methods)
    server = grpc.aio.server(options=ast.literal_eval(sys.argv[1]))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def _echo_through_a_stall(port: int, server_pid: int, options: tuple) -> str:
    """Write and read the stream for a second, stop the server for STALL_S, continue it and read on:
    "ok", or the error that ended the stream."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=list(options)) as channel:
        call = channel.stream_stream(f"/{SERVICE}/{METHOD}")()
        payload = b"x" * 4096

        async def exchange(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await call.write(payload)
                assert await call.read() == payload
                await asyncio.sleep(0.02)

        try:
            await exchange(1.0)
            await call.write(payload)  # in flight as the server stops
            os.kill(server_pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(STALL_S)
            finally:
                os.kill(server_pid, signal.SIGCONT)
            assert await asyncio.wait_for(call.read(), 10) == payload
            await asyncio.wait_for(exchange(1.0), 10)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
    return "ok"


def _stall(options_server: tuple, options_channel: tuple, tmp_path: Path) -> str:
    script = tmp_path / "echo_server.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), repr(options_server)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        return asyncio.run(_echo_through_a_stall(port, proc.pid, options_channel))
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(120)
def test_a_stopped_node_does_not_break_the_stream(tmp_path: Path) -> None:
    assert _stall(SERVER_OPTIONS, CHANNEL_OPTIONS + PINGING, tmp_path) == "ok"


@pytest.mark.timeout(120)
def test_the_same_stall_breaks_a_stream_with_a_short_ping_timeout(tmp_path: Path) -> None:
    outcome = _stall(SERVER_OPTIONS, MESSAGE_LIMITS + PINGING + SHORT_PING_TIMEOUT, tmp_path)
    assert "ping timeout" in outcome
