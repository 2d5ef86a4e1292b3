"""Rank processes: started with ``spawn`` from one entry point, readiness acknowledged, failures detected.

The driver (the node's main process) owns one pipe per rank. Each rank joins the
``torch.distributed`` world (gloo on CPU, NCCL on GPU), acknowledges with ``Ready``, then runs the
given ``target(ctx)``, which serves messages from ``ctx.conn``. If any rank dies or raises, the
driver's next ``recv`` raises ``RankFailure`` and every other rank is stopped (terminate, then kill
after a grace period), so a crash never leaves processes behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.net import free_port
from engine.parallel.rank_messages import RankError, Ready, Stop


class RankFailure(RuntimeError):
    """A rank process died or raised; the whole group has been stopped."""


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    payload: Any
    conn: Connection


def _rank_main(
    target: Callable[[RankContext], None],
    rank: int,
    world_size: int,
    payload: Any,
    conn: Connection,
    init_method: str,
    backend: str | None,
    timeout_s: float,
    gpus: list[int] | None,
) -> None:
    import logging

    import torch.distributed as dist

    from engine import envs

    # the node's log format and level, with the process name (pd-rank-N): spawned processes start unconfigured
    logging.basicConfig(level=envs.log_level(), format=envs.LOG_FORMAT)
    try:
        if gpus is not None:  # one GPU per rank, chosen before NCCL (or anything else) sees the process
            import torch

            torch.cuda.set_device(gpus[rank])
        if backend is not None:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size,
                timeout=timedelta(seconds=timeout_s))
        conn.send(Ready(rank))
        target(RankContext(rank, world_size, payload, conn))
    except BaseException:  # report anything, then exit non-zero
        try:
            conn.send(RankError(f"rank {rank}: {traceback.format_exc()}"))
        except (OSError, EOFError):
            pass
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# The least a group's start waits for its ranks (spawned, torch imported, the group joined, the model loaded),
# whatever its per-step timeout: a short ``rank_timeout_s`` (one that fails a hung rank quickly) would otherwise
# fail a start on a busy host, where several processes importing torch on 2 cores take over 15 s.
STARTUP_MIN_S = 120.0


class RankGroup:
    """``world_size`` rank processes running ``target``; the driver talks to them over pipes."""

    def __init__(
        self,
        target: Callable[[RankContext], None],
        world_size: int,
        payloads: list[Any],
        backend: str | None = "gloo",
        host: str = "127.0.0.1",
        port: int | None = None,
        collective_timeout_s: float = 300.0,
        gpus: list[int] | None = None,
    ) -> None:
        """With ``gpus``, rank r runs on GPU ``gpus[r]`` (NCCL needs them). ``backend`` None: independent
        processes, no ``torch.distributed`` world (decode DP replicas)."""
        if len(payloads) != world_size:
            raise ValueError(f"{world_size} ranks but {len(payloads)} payloads")
        self.world_size = world_size
        self._target = target
        self._payloads = payloads
        self._backend = backend
        self._init = f"tcp://{host}:{port or free_port(host)}"
        self._timeout = collective_timeout_s
        if gpus is not None and len(gpus) < world_size:
            raise ValueError(f"{world_size} ranks but {len(gpus)} GPUs")
        self._gpus = gpus
        self._procs: list[mp.process.BaseProcess] = []
        self._stopped: str | None = None  # why the group was stopped, once it was
        self._failure: str | None = None  # the first failure seen: every later use of the group raises it
        self._conns: list[Connection] = []

    def start(self, ready_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(self._target, rank, self.world_size, self._payloads[rank], child, self._init,
                      self._backend, self._timeout, self._gpus),
                name=f"pd-rank-{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        for rank in range(self.world_size):
            msg = self.recv(rank, ready_timeout_s)
            if msg != Ready(rank):
                self.shutdown()
                raise RankFailure(f"rank {rank} sent {msg!r} instead of its ready acknowledgement")

    def _check_running(self) -> None:
        if self._failure is not None:  # whichever thread uses the group next hears the cause, not its effect
            raise RankFailure(self._failure)
        if self._stopped is not None:
            raise RankFailure(f"the rank group is stopped ({self._stopped})")

    def send(self, rank: int, msg: Any) -> None:
        self._check_running()
        try:
            self._conns[rank].send(msg)
        except (OSError, EOFError) as e:
            self._fail(f"rank {rank} is gone ({e})")

    def broadcast(self, msg: Any) -> None:
        for r in range(self.world_size):
            self.send(r, msg)

    def recv(self, rank: int, timeout_s: float = 600.0) -> Any:
        """The next message from ``rank``; raises RankFailure if any rank dies or errs meanwhile."""
        self._check_running()
        conn = self._conns[rank]
        deadline = time.monotonic() + timeout_s
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"rank {rank} did not answer within {timeout_s:.0f}s")
            ready = wait([conn, *sentinels], timeout=min(left, 1.0))
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail(f"rank {rank} closed its pipe")
                if isinstance(msg, RankError):
                    self._fail(self._root_cause(rank, msg.text))
                return msg
            for s in ready:
                if s in sentinels:
                    i = sentinels[s]
                    self._fail(self._last_words(i) or f"rank {i} exited with code {self._procs[i].exitcode}")

    def recv_ready(self, timeout_s: float) -> list[tuple[int, Any]]:
        """One message from every rank that has one, as (rank, message), waiting up to ``timeout_s`` for
        the first (every ready rank is read, so a busy one cannot starve the others); raises RankFailure
        if a rank dies or errs."""
        self._check_running()
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        conns = {c: i for i, c in enumerate(self._conns)}
        ready = wait([*conns, *sentinels], timeout=timeout_s)
        out = []
        for c in ready:
            if c in conns:
                rank = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    self._fail(f"rank {rank} closed its pipe")
                if isinstance(msg, RankError):
                    self._fail(self._root_cause(rank, msg.text))
                out.append((rank, msg))
        if not out:
            for s in ready:
                if s in sentinels:
                    i = sentinels[s]
                    self._fail(self._last_words(i) or f"rank {i} exited with code {self._procs[i].exitcode}")
        return out

    def _root_cause(self, rank: int, error: str, wait_s: float = 0.5) -> str:
        """``rank``'s error, or, when another rank died (a collective then fails in the survivors
        first), the dead rank named first and the survivor's error after it, as its effect. Waits up
        to ``wait_s`` for a dying peer to be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [i for i, p in enumerate(self._procs) if i != rank and p.exitcode is not None]
            if dead:
                i = dead[0]
                cause = self._last_words(i) or f"rank {i} exited with code {self._procs[i].exitcode}"
                return f"{cause}; then {error}"
            left = deadline - time.monotonic()
            if left <= 0:
                return error
            wait([p.sentinel for j, p in enumerate(self._procs) if j != rank], timeout=left)

    def _last_words(self, rank: int) -> str | None:
        """The error a dead rank sent before exiting, if it is still in its pipe."""
        conn = self._conns[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, RankError):
                    return msg.text
        except (EOFError, OSError):
            pass
        return None

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
        # Survivors are likely blocked in a collective with the dead rank: a short grace, then terminate.
        self.shutdown(grace_s=2.0, why=why)
        raise RankFailure(self._failure)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def shutdown(self, grace_s: float = 5.0, why: str = "shut down") -> None:
        """Ask every rank to stop, then terminate, then kill: returns within ~2 × grace_s."""
        if self._stopped is None:  # at once: other threads stop using the group while it stops
            self._stopped = why.splitlines()[0]
        for c in self._conns:
            try:
                c.send(Stop())
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self._conns:
            c.close()
        self._conns = []
        self._procs = []

    def __enter__(self) -> RankGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
