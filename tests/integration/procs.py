"""Spawned child processes of the test process."""

from __future__ import annotations

import psutil


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
