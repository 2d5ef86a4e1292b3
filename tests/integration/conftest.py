"""Integration tests run real processes: none may outlive its test."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from procs import rank_children


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while rank_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = rank_children()
    for p in left:
        p.kill()
    assert not left, f"test left processes behind: {[p.pid for p in left]}"
