"""The proxy's circuit breaker per node: closed -> open on failures -> half-open on a passing probe ->
closed on a good call (or open again on a bad one)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proxy.routing.breaker import (
    CLOSED,
    HALF_OPEN,
    NO_ANSWER,
    NOT_SERVING,
    OPEN,
    REFUSED,
    SERVING,
    Breakers,
    check_health,
)


def test_consecutive_failures_open_a_breaker_and_a_success_in_between_resets_the_count() -> None:
    moves: list[tuple[str, str]] = []
    b = Breakers(failure_threshold=3, on_change=lambda node, state: moves.append((node, state)))
    b.failure("n")
    b.failure("n")
    b.success("n")  # the count is of failures in a row
    b.failure("n")
    b.failure("n")
    assert b.state("n") == CLOSED and not b.is_open("n")
    b.failure("n")
    assert b.state("n") == OPEN and b.open_nodes() == ["n"] and moves == [("n", OPEN)]


def test_a_refused_connection_opens_at_once_and_probes_then_a_call_decide() -> None:
    b = Breakers(failure_threshold=3)
    b.failure("n", refused=True)
    assert b.is_open("n")
    b.probe("n", REFUSED)
    assert b.is_open("n")  # still down
    b.probe("n", SERVING)
    assert b.state("n") == HALF_OPEN and not b.is_open("n")  # routable: the next call decides
    b.failure("n")  # one failure while half-open reopens
    assert b.is_open("n")
    b.probe("n", SERVING)
    b.success("n")
    assert b.state("n") == CLOSED


def test_a_probe_that_finds_a_closed_node_down_opens_it_and_reset_and_forget_clear_state() -> None:
    b = Breakers()
    b.probe("a", SERVING)
    assert b.state("a") == CLOSED  # a serving node stays closed
    b.probe("a", NOT_SERVING)  # (the registry is away: every node is probed)
    assert b.is_open("a")
    b.reset("a")
    assert b.state("a") == CLOSED
    b.failure("gone", refused=True)
    b.forget(["a"])
    assert b.states() == {"a": CLOSED}
    with pytest.raises(ValueError, match="failure_threshold"):
        Breakers(failure_threshold=0)
    with pytest.raises(ValueError, match="outcome"):
        b.probe("a", "maybe")


def test_a_probe_without_an_answer_opens_only_after_the_threshold_in_a_row() -> None:
    """A busy host can miss one probe's deadline (the same stall that timed the registry out): that
    alone must not take a serving node out of routing; a refusal or NOT_SERVING still does."""
    b = Breakers(failure_threshold=3)
    b.probe("n", NO_ANSWER)
    b.probe("n", NO_ANSWER)
    b.probe("n", SERVING)  # an answer resets the run
    b.probe("n", NO_ANSWER)
    b.probe("n", NO_ANSWER)
    assert b.state("n") == CLOSED
    b.probe("n", NO_ANSWER)
    assert b.is_open("n")
    b.probe("n", SERVING)
    b.success("n")
    assert b.state("n") == CLOSED
    b.probe("n", NO_ANSWER)
    b.probe("n", NO_ANSWER)
    b.success("n")  # so does a call it answered (an outage's misses do not add to the next one's)
    b.probe("n", NO_ANSWER)
    assert b.state("n") == CLOSED
    b.probe("n", NO_ANSWER)
    b.reset("n")  # an operator's reset clears the run too
    b.probe("n", NO_ANSWER)
    assert b.state("n") == CLOSED
    b.probe("n", REFUSED)
    assert b.is_open("n")


class _SlowHealth(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):  # noqa: N802 (gRPC's name)
        await asyncio.sleep(5)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_check_health_tells_serving_not_serving_refused_and_no_answer_apart() -> None:
    async def main() -> list[str]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        slow = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_SlowHealth(), slow)
        slow_port = slow.add_insecure_port("127.0.0.1:0")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        await server.start()
        await slow.start()
        try:
            out = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
                out.append(await check_health(ch, 2.0))
                await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                out.append(await check_health(ch, 2.0))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{free}") as ch:
                out.append(await check_health(ch, 2.0))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{slow_port}") as ch:
                out.append(await check_health(ch, 0.3))
            return out
        finally:
            await server.stop(None)
            await slow.stop(None)

    assert asyncio.run(main()) == [SERVING, NOT_SERVING, REFUSED, NO_ANSWER]
