"""Spawned child processes of the test process."""

from __future__ import annotations

import subprocess
import time

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
