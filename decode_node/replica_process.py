"""Decode DP replicas as processes: one per GPU, started with the rank launcher the prefill side uses.

A replica's host work (scheduling, sampling, stop checks, token events) is Python; as threads of one
process, DP replicas and the node's gRPC server share one interpreter lock. As processes each replica
has its own: the node's process keeps the gRPC service and routes requests, and every replica process
runs the same ``Replica`` (engine loop, KV pulls through its own transport, confirmations to the
prefill node) as the threaded mode does.

Pipe protocol (pickled; ``engine.parallel.rank_group``): the node sends ``StartJob``, ``AbortJob``,
``AbortJobs`` and ``Stop``; a replica sends ``ReplicaUp`` once its engine is ready, then ``JobEvents``
(what one iteration of its engine loop emitted, ``decode_node.outbox``: items of requests' event
streams, each a ``DecodeEvent``, an exception, or None at the end),
``LoadReport`` when its load or transfer totals change (or its prefix cache does: its KV events),
and ``ReplicaFailed`` if its engine fails.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from decode_node.outbox import Item, to_loops
from engine.engine_config import EngineConfig
from engine.parallel.rank_group import RankContext, RankFailure, RankGroup
from engine.parallel.rank_messages import Stop
from engine.prefix_cache import split_events
from engine.sampling_params import SamplingParams
from kv_transfer.handle import KVSource
from kv_transfer.handoff import TransferStats

if TYPE_CHECKING:
    from decode_node.worker import DecodeJob, DecodeWorker

log = logging.getLogger("pdcluster.decode")
REPORT_EVERY_S = 0.05  # a replica process reports a changed load at most this often


# -- node -> replica -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first: bytes  # pb.Token, serialized
    source: KVSource | None  # None: a local prefill
    t_submit: float  # time.monotonic() (system-wide on Linux)


@dataclass(frozen=True)
class AbortJob:
    request_id: str


@dataclass(frozen=True)
class AbortJobs:
    why: str


# -- replica -> node -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaUp:
    max_model_len: int
    num_blocks: int


@dataclass(frozen=True)
class JobEvents:
    items: list[tuple[str, Any]]  # (request id, a pb.DecodeEvent serialized, an exception, or None: the end)


@dataclass(frozen=True)
class LoadReport:
    load: ReplicaLoad
    transfers: tuple[int, int, float, dict[str, int]]  # done, bytes, seconds, failures by cause
    kv_events: tuple[list[int], list[int]] = ([], [])  # prefix cache: hashes stored, evicted since the last


@dataclass(frozen=True)
class ReplicaFailed:
    why: str


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    config: EngineConfig  # this replica's (dp=1, its own device)
    transfer_host: str
    kv_protocol: str
    timeout_s: float


# -- the replica process ---------------------------------------------------------------------------
class _Link:
    """The replica's side of the pipe, shared by its engine thread and its main loop."""

    def __init__(self, ctx: RankContext) -> None:
        self.conn = ctx.conn
        self.lock = threading.Lock()  # the engine thread and the main loop both send

    def send(self, msg: object) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (pickle.PickleError, TypeError, AttributeError, ValueError) as e:  # an item that does not pickle
                if isinstance(msg, JobEvents):  # an exception that does not: its text instead
                    self.conn.send(JobEvents([(rid, item if _pickles(item)
                                               else RuntimeError(f"{type(item).__name__}: {item}"))
                                              for rid, item in msg.items]))
                else:
                    raise RuntimeError(f"cannot send {type(msg).__name__} to the node: {e}") from e


def _pickles(item: object) -> bool:
    if item is None or isinstance(item, bytes):
        return True
    try:
        pickle.dumps(item)
        return True
    except Exception:
        return False


class _ProcessWorker:
    """What a ``Replica`` asks of its worker, inside a replica process."""

    def __init__(self, link: _Link) -> None:
        from node_runtime.confirm import PrefillConfirmer

        self.confirm = PrefillConfirmer()
        self.link = link

    def fail(self, why: str) -> None:
        self.link.send(ReplicaFailed(why))

    def deliver(self, items: list[Item]) -> None:
        """An engine-loop iteration's events: one message to the node. Protobuf messages travel
        serialized (the generated classes do not pickle by module path)."""
        self.link.send(JobEvents([(job.request_id, item.SerializeToString() if isinstance(item, pb.DecodeEvent)
                                   else item) for job, item in items]))


def serve_replica(ctx: RankContext) -> None:
    """Body of a replica process: build the replica, then relay messages until ``Stop``."""
    from decode_node.worker import Abort, AbortAll, DecodeJob, Replica  # imports this module: not at the top
    from decode_node.worker import Start as StartMsg
    from kv_transfer.transports.mooncake import MooncakeTransport

    spec: ReplicaSpec = ctx.payload
    link = _Link(ctx)
    transport = MooncakeTransport(host=spec.transfer_host, protocol=spec.kv_protocol)
    stats = TransferStats()
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
    worker = _ProcessWorker(link)
    replica = Replica(spec.index, spec.config, transport, stats, spec.timeout_s, pool, worker)  # type: ignore[arg-type]

    link.send(ReplicaUp(replica.engine.max_model_len, replica.load.free_blocks))
    last: object = None
    try:
        while True:
            if ctx.conn.poll(REPORT_EVERY_S):
                msg = ctx.conn.recv()
                match msg:
                    case StartJob():
                        job = DecodeJob(msg.request_id, msg.prompt, msg.params, pb.Token.FromString(msg.first),
                                        msg.source, None, None, t_submit=msg.t_submit)
                        replica.send(StartMsg(job))
                    case AbortJob(rid):
                        replica.send(Abort(rid))
                    case AbortJobs(why):
                        replica.send(AbortAll(why))
                    case Stop():
                        return
                    case _:
                        raise TypeError(f"unknown message {msg!r}")
            report = LoadReport(replica.load, (stats.done, stats.bytes, stats.seconds, dict(stats.failures)))
            events = replica.engine.take_kv_events()
            if report != last or events[0] or events[1]:
                link.send(LoadReport(report.load, report.transfers, events))
                last = report
    finally:
        replica.request_stop()
        replica.join()
        pool.shutdown(wait=True, cancel_futures=True)
        transport.close()
        worker.confirm.close()


# -- the node's side -------------------------------------------------------------------------------
def _parse(item: Any) -> Any:
    """A ``JobEvents`` item as the stream takes it: a ``DecodeEvent`` (or the exception it could not
    be parsed into), an exception, or None."""
    if not isinstance(item, bytes):
        return item
    try:
        return pb.DecodeEvent.FromString(item)
    except Exception as e:
        return RuntimeError(f"a decode event did not parse: {e}")


class RemoteReplica:
    """A replica process as the node sees it: its jobs, its last reported load, and ``send``."""

    def __init__(self, index: int, processes: ReplicaProcesses) -> None:
        self.index = index
        self.processes = processes
        self.jobs: dict[str, DecodeJob] = {}
        self.load = ReplicaLoad(dp_rank=index)
        self.transfers: tuple[int, int, float, dict[str, int]] = (0, 0, 0.0, {})
        self.kv_events: dict[int, bool] = {}  # prefix cache: hash -> stored (True) or evicted, not yet taken

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        events, self.kv_events = self.kv_events, {}
        return split_events(events)

    def send(self, message: object) -> None:
        from decode_node.worker import Abort, AbortAll, Start

        match message:
            case Start(job):
                with self.processes.lock:
                    if job.request_id in self.jobs:  # the engine would refuse it, and this node lose the first
                        job.emit(ValueError(f"request id {job.request_id!r} is already in flight"))
                        return
                    job.replica = self.index
                    self.jobs[job.request_id] = job
                    self.processes.send(self.index, StartJob(job.request_id, job.prompt, job.params,
                                                             job.first.SerializeToString(), job.source,
                                                             job.t_submit))
            case Abort(rid):
                if rid in self.jobs:
                    self.processes.send(self.index, AbortJob(rid))
            case AbortAll(why):
                self.processes.send(self.index, AbortJobs(why))
            case _:
                raise TypeError(f"unknown message {message!r}")


class ReplicaProcesses:
    """Starts the replica processes, relays their messages to jobs (on a reader thread), stops them."""

    def __init__(self, worker: DecodeWorker, configs: list[EngineConfig], gpus: list[int] | None, transfer_host: str,
                 kv_protocol: str, timeout_s: float, start_timeout_s: float) -> None:
        self.worker = worker
        specs = [ReplicaSpec(d, c, transfer_host, kv_protocol, timeout_s) for d, c in enumerate(configs)]
        self.group = RankGroup(serve_replica, len(specs), specs, backend=None, gpus=gpus)
        self.replicas = [RemoteReplica(d, self) for d in range(len(specs))]
        self.lock = threading.RLock()  # the pipes' sends and the jobs tables
        self._stopping = False
        self.group.start(ready_timeout_s=start_timeout_s)
        try:
            ups = [self._expect_up(d, start_timeout_s) for d in range(len(specs))]
        except BaseException:
            self.group.shutdown()
            raise
        self.max_model_len = ups[0].max_model_len
        self.num_blocks = ups[0].num_blocks
        for r, up in zip(self.replicas, ups):
            r.load = dataclasses.replace(r.load, free_blocks=up.num_blocks)
        self._reader = threading.Thread(target=self._read, name="decode-replicas", daemon=True)
        self._reader.start()

    def _expect_up(self, d: int, timeout_s: float) -> ReplicaUp:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.group.recv(d, max(deadline - time.monotonic(), 0.001))
            if isinstance(msg, ReplicaUp):
                return msg
            if not isinstance(msg, LoadReport):
                raise RankFailure(f"replica {d} sent {str(msg)[:80]} before it was up")

    def send(self, d: int, msg: object) -> None:
        with self.lock:
            try:
                self.group.send(d, msg)
            except RankFailure as e:
                self._failed(str(e))

    def _read(self) -> None:
        while not self._stopping:
            try:
                for d, msg in self.group.recv_ready(0.5):
                    self._dispatch(d, msg)
            except Exception as e:  # a dead replica, or anything else: no event would be read again
                if not self._stopping:
                    self._failed(str(e) if isinstance(e, RankFailure) else f"{type(e).__name__}: {e}")
                return

    def _dispatch(self, d: int, msg: object) -> None:
        replica = self.replicas[d]
        match msg:
            case JobEvents(items):
                # parsed before the jobs table changes: a message that does not parse fails only its stream
                parsed = [(rid, _parse(item)) for rid, item in items]
                out: list[Item] = []
                with self.lock:
                    for rid, item in parsed:
                        job = replica.jobs.get(rid)
                        if job is None:
                            continue
                        if item is None or isinstance(item, BaseException):
                            del replica.jobs[rid]
                        else:
                            job.admitted = job.admitted or item.HasField("admitted")
                        out.append((job, item))
                to_loops(out)
            case LoadReport(load, transfers, (stored, removed)):
                replica.load = load
                replica.transfers = transfers
                replica.kv_events.update(dict.fromkeys(stored, True))
                replica.kv_events.update(dict.fromkeys(removed, False))
            case ReplicaFailed(why):
                self._failed(f"replica {d}: {why}")
            case _:
                log.warning("replica %d sent an unknown message %r", d, msg)

    def _failed(self, why: str) -> None:
        self.worker.fail(why)
        for r in self.replicas:
            with self.lock:  # submit() adds jobs from the event loop's thread
                jobs = list(r.jobs.values())
                r.jobs.clear()
            for job in jobs:
                job.emit(RuntimeError("the decode engine failed"))

    def stats(self) -> tuple[int, int, float, dict[str, int]]:
        done, nbytes, secs = 0, 0, 0.0
        fails: dict[str, int] = {}
        for r in self.replicas:
            d, b, s, f = r.transfers
            done, nbytes, secs = done + d, nbytes + b, secs + s
            for k, v in f.items():
                fails[k] = fails.get(k, 0) + v
        return done, nbytes, secs, fails

    def pids(self) -> list[int]:
        return self.group.pids()

    def shutdown(self) -> None:
        self._stopping = True
        self.group.shutdown(grace_s=10.0, why="the decode node stopped")
        self._reader.join(timeout=5.0)
