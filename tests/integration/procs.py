"""Spawned child processes of the test process, and waiting for what they do."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import psutil

from cluster.nodes import NodeState
from cluster.registry import Registry


def rank_children() -> list[psutil.Process]:
    """Live spawned children (multiprocessing's resource tracker, also a child, is not one)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_registered(proc: subprocess.Popen, registry: Registry, timeout_s: float = 90.0) -> NodeState:
    """The first node ``proc`` registers, once it has; fails if it exits or takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not registry.nodes():
        assert proc.poll() is None, "the node exited"
        assert time.monotonic() < deadline, "the node did not register"
        time.sleep(0.2)
    return registry.nodes()[0]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Return as soon as ``predicate()`` holds (polled every ``interval_s``); fail naming ``what`` was awaited
    if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout_s:.1f} s for {what}"
        time.sleep(interval_s)
