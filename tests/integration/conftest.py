"""Integration tests run real processes: none may outlive its test."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from procs import rank_children


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    # Processes of wider-scoped fixtures (set up before this one: a module's cluster, e.g. its proxy's
    # server worker) belong to them, not to the test.
    before = {p.pid for p in rank_children()}
    yield

    def new() -> list:
        return [p for p in rank_children() if p.pid not in before]

    deadline = time.monotonic() + 5
    while new() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = new()
    for p in left:
        p.kill()
    assert not left, f"test left processes behind: {[p.pid for p in left]}"
