"""Processes started as process-group leaders, and stopping them from another process.

``pdctl up`` starts every cluster process in a new session, so the rank processes a node spawns
share its process group; ``pdctl down``, a different process, stops each group by the pid recorded
in the state file:

1. SIGTERM to the leader only: a node then finishes or aborts its in-flight requests, deregisters
   and stops its own ranks (signalling the ranks at the same time would kill them under requests
   the node is still finishing);
2. after the grace period, SIGTERM to whatever is left of the group, and a moment later SIGKILL.

PID reuse guard: a record carries its leader's start time (Linux ``/proc``); a live pid with
another start time is someone else's process and is left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_POLL_S = 0.05


@dataclass(frozen=True)
class ProcessRecord:
    """A process group that ``pdctl up`` started: what ``pdctl down`` needs to stop it."""

    name: str
    pid: int  # the leader; the group id equals it (a new session)
    start_time: str | None  # the leader's start time in /proc (None where there is no /proc)
    log: str
    port: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ProcessRecord:
        return ProcessRecord(name=str(d["name"]), pid=int(d["pid"]), start_time=d.get("start_time"),
                             log=str(d["log"]), port=d.get("port"))


def spawn(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
          port: int | None = None) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` as the leader of a new session, stdout and stderr appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=None if env is None else dict(env))
    return proc, record_of(name, proc.pid, log_path, port)


def record_of(name: str, pid: int, log_path: Path, port: int | None = None) -> ProcessRecord:
    """The record of a group leader started elsewhere (e.g. the local redis-server)."""
    return ProcessRecord(name=name, pid=pid, start_time=_start_time(pid), log=str(log_path), port=port)


def is_running(record: ProcessRecord) -> bool:
    """Whether anything of this group still runs (the leader, or processes it left behind)."""
    return _ours(record) and bool(_group_members(record.pid))


def stop_groups(records: Sequence[ProcessRecord], grace_s: float, kill_wait_s: float = 5.0) -> list[str]:
    """Stop these groups together (see the module docstring); returns the names that survived."""
    mine = [r for r in records if _ours(r)]
    for r in mine:
        _signal(r.pid, signal.SIGTERM)
    _wait(lambda: not any(_leader_alive(r.pid) for r in mine), grace_s)
    left = [r for r in mine if _group_members(r.pid)]
    for r in left:
        _signal_group(r.pid, signal.SIGTERM)
    _wait(lambda: not any(_group_members(r.pid) for r in left), min(2.0, grace_s))
    for r in left:
        _signal_group(r.pid, signal.SIGKILL)
    _wait(lambda: not any(_group_members(r.pid) for r in left), kill_wait_s)
    return [r.name for r in left if _group_members(r.pid)]


def _ours(record: ProcessRecord) -> bool:
    # A live leader with another start time means the pid was reused; while any member of our
    # group lives, Linux does not reuse the group id, so a dead leader is safe to signal around.
    stat = _stat(record.pid)
    return stat is None or record.start_time is None or stat[2] == record.start_time


def _leader_alive(pid: int) -> bool:
    _reap(pid)
    stat = _stat(pid)
    if stat is not None:
        return stat[0] != "Z"
    if _PROC.is_dir():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the group."""
    _reap(pgid)
    if not _PROC.is_dir():  # no /proc (macOS): ask the kernel whether the group exists at all
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    members = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                members.append(int(entry.name))
    return members


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, process group, start time) from /proc/<pid>/stat; None if there is no such process."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return rest[0], int(rest[2]), rest[19]


def _start_time(pid: int) -> str | None:
    stat = _stat(pid)
    return None if stat is None else stat[2]


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (pdctl down): its parent or init reaps it


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
