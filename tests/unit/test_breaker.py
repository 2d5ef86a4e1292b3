"""The proxy's circuit breaker per node: closed -> open on failures -> half-open on a passing probe ->
closed on a good call (or open again on a bad one)."""

from __future__ import annotations

import pytest

from proxy.breaker import CLOSED, HALF_OPEN, OPEN, Breakers


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
    b.probe("n", serving=False)
    assert b.is_open("n")  # still down
    b.probe("n", serving=True)
    assert b.state("n") == HALF_OPEN and not b.is_open("n")  # routable: the next call decides
    b.failure("n")  # one failure while half-open reopens
    assert b.is_open("n")
    b.probe("n", serving=True)
    b.success("n")
    assert b.state("n") == CLOSED


def test_a_probe_that_finds_a_closed_node_down_opens_it_and_reset_and_forget_clear_state() -> None:
    b = Breakers()
    b.probe("a", serving=True)
    assert b.state("a") == CLOSED  # a serving node stays closed
    b.probe("a", serving=False)  # (the registry is away: every node is probed)
    assert b.is_open("a")
    b.reset("a")
    assert b.state("a") == CLOSED
    b.failure("gone", refused=True)
    b.forget(["a"])
    assert b.states() == {"a": CLOSED}
    with pytest.raises(ValueError, match="failure_threshold"):
        Breakers(failure_threshold=0)
