"""Each proxy worker process on one CPU core.

A worker's request passes between its threads many times: the event loop, granian's HTTP runtime and
gRPC's poller and event-engine threads. Kept on one core, those hand-offs are context switches; spread
over cores, each is a cross-core wake-up. On null nodes (``benchmarks/proxy.py``, 2-core machine) a
pinned worker added 1.26 ms p50 at concurrency 1 where an unpinned one added 1.60 ms, served 1.05–1.10×
the requests at concurrency 32 and 128, at 0.93 against 1.0–1.06 ms of CPU per request.

Workers take cores through a small claims file (``pid core`` lines under an exclusive lock), so each
takes the core with the fewest live workers, the highest-numbered first (core 0 takes most interrupts);
a respawned worker finds its predecessor's claim dead and takes its core.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMS_ENV = "PDCLUSTER_PROXY_CPU_CLAIMS"  # the claims file, set by the parent of the workers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def choose_core(allowed: set[int], claims: dict[int, int]) -> int:
    """The allowed core with the fewest claims (``pid -> core``), the highest-numbered among equals."""
    held = {c: 0 for c in allowed}
    for core in claims.values():
        if core in held:
            held[core] += 1
    return min(sorted(allowed, reverse=True), key=lambda c: held[c])


def claim_core(claims_file: Path) -> int:
    """Claim a core in ``claims_file`` for this process (dead processes' claims are dropped)."""
    allowed = os.sched_getaffinity(0)
    with open(claims_file, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        claims: dict[int, int] = {}
        for line in f.read().split("\n"):
            pid, _, held = line.partition(" ")
            if pid.isdigit() and held.isdigit() and _alive(int(pid)):
                claims[int(pid)] = int(held)
        core = choose_core(allowed, claims)
        claims[os.getpid()] = core
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {c}\n" for p, c in claims.items()))
    return core


def pin_this_worker() -> int | None:
    """Pin this process (every thread it has, and so every thread it starts later) to a claimed core.

    Called first thing in a worker, before it starts threads of its own. Returns the core, or None
    when no claims file is set (not a worker of ``python -m proxy``) or the process may run on one
    core only anyway.
    """
    claims = os.environ.get(CLAIMS_ENV)
    if not claims or len(os.sched_getaffinity(0)) < 2:
        return None
    core = claim_core(Path(claims))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that just ended
            pass
    log.info("worker %d pinned to CPU core %d", os.getpid(), core)
    return core
