"""The watch that reports the machine's own stalls in failed tests' reports (tests/host_stalls.py)."""

from __future__ import annotations

import time

import pytest
from host_stalls import HostStallWatch


def test_a_window_whose_cpu_time_never_ran_is_reported_where_it_overlaps(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = HostStallWatch(period=0.1, min_missing_s=0.3)
    time.sleep(0.3)
    t0 = time.time()
    frozen = HostStallWatch._ticks()
    monkeypatch.setattr(HostStallWatch, "_ticks", staticmethod(lambda: frozen))  # as a paused VM's counters
    time.sleep(1.0)
    assert len(watch.during(t0, time.time())) == 1  # reported while still under way
    monkeypatch.undo()
    time.sleep(0.4)  # the stall ends at the next window that ran
    (stall,) = watch.during(t0, time.time())
    assert "CPU-seconds never ran" in stall
    assert watch.during(t0 - 60, t0 - 30) == []  # and only where it overlaps
