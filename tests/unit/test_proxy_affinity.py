"""proxy.affinity: workers spread over the allowed cores, a dead worker's core is taken again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from proxy.affinity import choose_core, claim_core


def test_the_least_claimed_core_the_highest_first() -> None:
    assert choose_core({0, 1, 2, 3}, {}) == 3
    assert choose_core({0, 1, 2, 3}, {10: 3, 11: 2}) == 1
    assert choose_core({0, 1}, {10: 1, 11: 0, 12: 1}) == 0
    assert choose_core({4, 5}, {10: 0, 11: 5}) == 4  # claims on cores this process may not use count for nothing


def test_claims_of_dead_workers_are_dropped(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    allowed = sorted(os.sched_getaffinity(0))
    claims.write_text(f"{dead.pid} {allowed[-1]}\n")
    assert claim_core(claims) == allowed[-1]  # the dead worker's core, free again
    assert claims.read_text() == f"{os.getpid()} {allowed[-1]}\n"


_HELPERS = """
import os, threading, time
from proxy.affinity import keep_helpers_batched
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
keep_helpers_batched(every_s=0.1)
time.sleep(0.5)
late = threading.Thread(target=stop.wait); late.start()  # started after the first looks
time.sleep(3.5)
policy = os.sched_getscheduler
print(policy(0) == os.SCHED_OTHER, policy(early.native_id) == os.SCHED_BATCH, policy(late.native_id) == os.SCHED_BATCH)
stop.set()
"""


def test_helper_threads_run_batched_and_the_event_loop_does_not() -> None:
    """Every thread but the caller's (the event loop's) ends up under SCHED_BATCH, those started later too."""
    out = subprocess.run([sys.executable, "-c", _HELPERS], capture_output=True, text=True, timeout=30,
                         cwd=Path(__file__).resolve().parents[2], check=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr
