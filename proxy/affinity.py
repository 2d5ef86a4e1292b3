"""Each proxy worker process on one CPU core.

A worker's request passes between its threads many times: the event loop, granian's HTTP runtime and
gRPC's poller and event-engine threads. Kept on one core, those hand-offs are context switches; spread
over cores, each is a cross-core wake-up. On null nodes (``benchmarks/proxy.py``, 2-core machine) a
pinned worker added 1.26 ms p50 at concurrency 1 where an unpinned one added 1.60 ms, served 1.05–1.10×
the requests at concurrency 32 and 128, at 0.93 against 1.0–1.06 ms of CPU per request.

A pinned worker's helper threads (every thread but the event loop's) run under ``SCHED_BATCH``: the
kernel does not let a waking batch thread preempt the thread on the core, so granian's runtime and
gRPC's threads, woken by each send and write of the event loop, run when the loop waits instead of
taking the core from it at every hand-off. On null nodes: 1.10–1.13x the requests at concurrency 32
and 128, 0.50 against 0.57 ms of CPU per request (docs/benchmarks.md). The event loop keeps the
ordinary policy, so a request that arrives still wakes it at once (the whole process under
``SCHED_BATCH`` added 0.2 ms p50 at concurrency 1). Threads start during the worker's life (gRPC's
on its first call), so a small thread looks again every few seconds.

Workers take cores through a small claims file (``pid core`` lines under an exclusive lock), so each
takes the core with the fewest live workers, the highest-numbered first (core 0 takes most interrupts);
a respawned worker finds its predecessor's claim dead and takes its core.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
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


def batch_helpers(loop_tid: int) -> int:
    """Every thread of this process but ``loop_tid`` that runs under the ordinary policy now runs under
    ``SCHED_BATCH``; returns how many changed. Raises ``PermissionError`` where that is not allowed."""
    changed = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid == loop_tid:
            continue
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                changed += 1
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            pass
    return changed


def keep_helpers_batched(every_s: float = 5.0) -> threading.Thread:
    """From now on, keep the helper threads of this process (every thread but the calling one, the event
    loop's) under ``SCHED_BATCH``: a daemon thread applies ``batch_helpers`` soon and then every
    ``every_s`` seconds, for threads started later. Where the policy cannot be set, it logs once and
    stops: an optimisation, never a reason not to serve."""
    loop_tid = threading.get_native_id()

    def keep() -> None:
        for wait in (0.2, 1.0, 2.0):  # the threads of granian's runtime and of gRPC start in the first moments
            time.sleep(wait)
            if not _batch_or_stop(loop_tid):
                return
        while _batch_or_stop(loop_tid):
            time.sleep(every_s)

    thread = threading.Thread(target=keep, name="helpers-batch", daemon=True)
    thread.start()
    return thread


def _batch_or_stop(loop_tid: int) -> bool:
    try:
        batch_helpers(loop_tid)
        return True
    except (OSError, AttributeError) as e:  # no SCHED_BATCH here (not Linux, or not allowed)
        log.warning("helper threads left under the ordinary scheduling policy: %s", e)
        return False
