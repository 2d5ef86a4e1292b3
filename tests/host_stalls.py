"""The windows in which this machine's CPUs did not run at all (``HostStallWatch``), for failed tests' reports.

A test of a whole cluster that fails on a timeout may have been starved by the host, not by our code: CI's
2-core VMs have been seen to run almost nothing for two minutes (a CPU-bound loop got 1.5 s of 120), which
no process inside can cause or see but this way.
"""

from __future__ import annotations

import os
import threading
import time


class HostStallWatch:
    """Notes the windows in which this VM's vCPUs did not run (the host's doing, not ours).

    Every 0.5 s: the wall time since the last look, and the CPU time the kernel accounted over it
    (/proc/stat, every field: user..steal, idle included). Inside the guest those add up to the wall
    time times the CPUs however loaded the guest is; what is missing is time its vCPUs were not run and
    the host did not report as steal (a paused or starved VM, nested virtualization). A failed test's
    report lists the windows that overlap it."""

    def __init__(self, period: float = 0.5, min_missing_s: float = 2.0) -> None:
        self.period, self.min_missing_s = period, min_missing_s
        self.ncpu = os.cpu_count() or 1
        self.hz = os.sysconf("SC_CLK_TCK")
        self.stalls: list[tuple[float, float, float]] = []  # (start, end, missing CPU seconds), time.time()
        self.under_way: tuple[float, float, float] | None = None  # a stall not over at the last look
        threading.Thread(target=self._run, name="host-stall-watch", daemon=True).start()

    @staticmethod
    def _ticks() -> int:
        with open("/proc/stat") as f:
            return sum(int(x) for x in f.readline().split()[1:9])

    def _run(self) -> None:
        try:
            last_m, last_w, last_t = time.monotonic(), time.time(), self._ticks()
        except OSError:
            return  # not Linux
        while True:
            time.sleep(self.period)
            m, w, t = time.monotonic(), time.time(), self._ticks()
            missing = (m - last_m) * self.ncpu - (t - last_t) / self.hz
            if missing > 0.5 * (m - last_m) * self.ncpu:  # most of the window's CPU time never ran
                start, _, before = self.under_way or (last_w, w, 0.0)
                self.under_way = (start, w, before + missing)
            elif self.under_way is not None:
                if self.under_way[2] >= self.min_missing_s:
                    self.stalls.append(self.under_way)
                self.under_way = None
            last_m, last_w, last_t = m, w, t

    def during(self, start: float, stop: float) -> list[str]:
        """The stalls overlapping [start, stop] (time.time()), the one still under way too (a test that fails as
        the machine comes back is reported before the watch's next look ends it)."""
        now = self.under_way
        found = self.stalls + ([now] if now is not None and now[2] >= self.min_missing_s else [])
        return [f"{time.strftime('%H:%M:%S', time.localtime(a))} .. {time.strftime('%H:%M:%S', time.localtime(b))}:"
                f" {miss:.0f} of {(b - a) * self.ncpu:.0f} CPU-seconds never ran"
                for a, b, miss in found if b >= start and a <= stop]
