"""Rank processes: spawn + ready ack, collectives over gloo, crash detection and cleanup."""

from __future__ import annotations

import time

import pytest
from procs import rank_children
from rank_targets import allreduce_server

from engine.parallel.rank_group import RankFailure, RankGroup


def test_ranks_start_reduce_and_stop() -> None:
    with RankGroup(allreduce_server, 4, payloads=[f"p{i}" for i in range(4)]) as g:
        for r in range(4):
            g.send(r, ("sum", r + 1))
        replies = [g.recv(r, 30) for r in range(4)]
        assert [m[2] for m in replies] == [10.0] * 4
        assert [m[3] for m in replies] == ["p0", "p1", "p2", "p3"]
    assert not rank_children()


@pytest.mark.parametrize("how", ["crash", "raise"])
def test_a_failing_rank_stops_the_group_within_10s(how) -> None:
    g = RankGroup(allreduce_server, 3, payloads=[None] * 3)
    g.start()
    t0 = time.monotonic()
    g.send(1, (how,))
    # rank 0 enters a collective that can never complete; the driver must notice rank 1's failure
    g.send(0, ("sum", 1))
    with pytest.raises(RankFailure, match="rank 1"):
        g.recv(0, 60)
    assert time.monotonic() - t0 < 10
    assert not rank_children()
