"""Processes started as process-group leaders, and stopping them from another process.

``pdctl up`` starts every cluster process in a new session, so the rank processes a node spawns
share its process group; ``pdctl down``, a different process, stops each group by the pid recorded
in the state file:

1. SIGTERM to the leader only: a node then finishes or aborts its in-flight requests, deregisters
   and stops its own ranks (signalling the ranks at the same time would kill them under requests
   the node is still finishing);
2. after the grace period, SIGTERM to whatever is left of the group, and a moment later SIGKILL.

PID reuse guard: a record carries its leader's start time; a live pid with another start time is
someone else's process and is left alone. The start is compared as seconds since boot, within the
same boot (the kernel's boot id): psutil's ``create_time`` adds the boot time, which moves whenever
the wall clock is stepped (NTP, a VM resumed from a snapshot), so after such a step every record
would look like someone else's and ``pdctl down`` would stop nothing. Records without those fields
(earlier versions, systems without a boot id) fall back to the wall-clock start time.
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

import psutil

_POLL_S = 0.05
# Start times are the same process if this close: psutil derives them from the boot time, which
# the kernel reports in whole seconds and moves when the wall clock is stepped. A reused pid
# belongs to a process started long after ours ended.
_SAME_START_S = 1.0
_SAME_TICK_S = 0.005  # seconds since boot are whole clock ticks (10 ms): equal, up to float rounding
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class ProcessRecord:
    """A process group that ``pdctl up`` started: what ``pdctl down`` needs to stop it."""

    name: str
    pid: int  # the leader; the group id equals it (a new session)
    start_time: float | None  # the leader's start, seconds since the epoch (None: unknown, not checked)
    log: str
    port: int | None = None
    since_boot: float | None = None  # the leader's start, seconds since boot (clock steps do not move it)
    boot_id: str | None = None  # the boot ``since_boot`` counts from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ProcessRecord:
        since_boot, boot_id = d.get("since_boot"), d.get("boot_id")
        return ProcessRecord(name=str(d["name"]), pid=int(d["pid"]), start_time=_read_start_time(d.get("start_time")),
                             log=str(d["log"]), port=d.get("port"),
                             since_boot=None if since_boot is None else float(since_boot),
                             boot_id=None if boot_id is None else str(boot_id))


def _read_start_time(value: Any) -> float | None:
    """A record's start time; state files of earlier versions hold /proc's field instead (a string
    of clock ticks since boot), which is what psutil computes ``create_time`` from."""
    if value is None:
        return None
    if isinstance(value, str):
        return int(value) / os.sysconf("SC_CLK_TCK") + psutil.boot_time()
    return float(value)


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
    since_boot = _since_boot(pid)
    return ProcessRecord(name=name, pid=pid, start_time=_start_time(pid), log=str(log_path), port=port,
                         since_boot=since_boot, boot_id=_boot_id() if since_boot is not None else None)


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
    boot_id = _boot_id() if record.since_boot is not None and record.boot_id is not None else None
    if boot_id is not None:
        if boot_id != record.boot_id:  # the machine restarted since: nothing of ours runs
            return False
    elif record.start_time is None:
        return True
    try:
        if boot_id is not None:
            assert record.since_boot is not None
            since_boot = _since_boot(record.pid)
            if since_boot is None:  # gone (or hidden) since psutil saw it: nothing of ours to signal
                return not psutil.pid_exists(record.pid)
            return abs(since_boot - record.since_boot) < _SAME_TICK_S
        return abs(psutil.Process(record.pid).create_time() - record.start_time) < _SAME_START_S
    except psutil.NoSuchProcess:  # the leader is gone (a zombie still shows its start time)
        return True
    except psutil.AccessDenied:  # another user's process: not one we started
        return False


def _leader_alive(pid: int) -> bool:
    _reap(pid)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the group."""
    _reap(pgid)
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass  # ended meanwhile (or, for getpgid, in a session we may not look into: not ours)
        except psutil.AccessDenied:
            members.append(pid)  # in the group, but its state is hidden from us: alive as far as we know
    return members


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # already gone: nothing to guard
        return None


def _since_boot(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot (Linux: /proc's start time, in clock ticks, which
    no clock step moves; psutil has no public call for it, and its ``create_time`` minus
    ``boot_time`` only cancels the step on psutil 7), or None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, counted after the command's ")"
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    """The kernel's id of this boot (Linux), or None where there is none."""
    try:
        return Path(_BOOT_ID).read_text().strip() or None
    except OSError:
        return None


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
