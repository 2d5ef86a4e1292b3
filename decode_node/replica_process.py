"""Decode DP replicas as processes: one per GPU, started with the rank launcher the prefill side uses.

A replica's host work (scheduling, sampling, stop checks, token events) is Python; as threads of one
process, DP replicas and the node's gRPC server share one interpreter lock. As processes each replica
has its own: the node's process keeps the gRPC service and routes requests, and every replica process
runs the same ``decode_node.replica.Replica`` as the threaded mode does, with its own transport and
confirmer.

Pipe protocol (pickled; ``engine.parallel.rank_group``): the node sends the replica's own commands
(``node_runtime.commands``: ``Start`` with a ``Job``, ``Abort``, ``AbortAll``; under expert parallelism
``decode_node.waves.Wake``) and ``Stop``; a replica sends ``ReplicaUp`` once its engine is ready, then
``Events`` (what one iteration of its engine loop emitted: (request id, event) pairs, each event a
serialized ``DecodeEvent``, an exception, or None at the end), ``LoadReport`` when its load or transfer
totals change (or its prefix cache does: its KV events), and under expert parallelism ``WaveStarted``,
which the node relays to every other replica as a ``Wake``. A replica whose engine fails ends as any
failed rank does: its process raises, the rank launcher sends ``RankError`` and the node's reader gets
``RankFailure``.

With expert parallelism the replica processes are one ``torch.distributed`` world (gloo on CPU, NCCL on
GPUs, with the collective timeout ``rank_timeout_s``), and that world is the node's EP group.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from decode_node.replica import Event, Replica
from decode_node.waves import Wake
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.parallel.expert_parallel import ExpertGroup
from engine.parallel.rank_group import STARTUP_MIN_S, RankContext, RankFailure, RankGroup
from engine.parallel.rank_messages import Stop
from engine.prefix_cache import split_events
from kv_transfer.handoff import Totals
from node_runtime.commands import Abort, AbortAll, Start
from node_runtime.confirm import PrefillConfirmer

log = logging.getLogger("pdcluster.decode")
REPORT_EVERY_S = 0.05  # a replica process reports a changed load at most this often


# -- replica -> node -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaUp:
    max_model_len: int
    num_blocks: int
    expert_params: int  # routed-expert parameters it holds (1/DP of the model's under expert parallelism)


@dataclass(frozen=True)
class Events:
    items: list[tuple[str, Any]]  # (request id, a pb.DecodeEvent serialized, an exception, or None: the end)


@dataclass(frozen=True)
class WaveStarted:
    wave: int  # this replica started EP wave ``wave``: the others must join it (decode_node.waves)


@dataclass(frozen=True)
class LoadReport:
    load: ReplicaLoad
    transfers: Totals
    kv_events: tuple[list[int], list[int]] = ([], [])  # prefix cache: hashes stored, evicted since the last


@dataclass(frozen=True)
class ReplicaSpec:
    index: int
    config: EngineConfig  # this replica's (dp=1, its own device)
    transfer_host: str
    kv_protocol: str
    timeout_s: float
    expert_parallel: bool = False  # the replica processes' world is the node's EP group


# -- the replica process ---------------------------------------------------------------------------
class _Link:
    """The replica's side of the pipe, shared by its engine thread and its main loop; the replica's
    owner (``ReplicaOwner``) in its process."""

    def __init__(self, ctx: RankContext) -> None:
        self.conn = ctx.conn
        self.lock = threading.Lock()  # the engine thread and the main loop both send
        self.confirmer = PrefillConfirmer()
        self.failure: str | None = None  # the engine failed: the process ends (``serve_replica``)

    def send(self, msg: object) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (pickle.PickleError, TypeError, AttributeError, ValueError) as e:  # an item that does not pickle
                if isinstance(msg, Events):  # an exception that does not: its text instead
                    self.conn.send(Events([(rid, item if _pickles(item)
                                            else RuntimeError(f"{type(item).__name__}: {item}"))
                                           for rid, item in msg.items]))
                else:
                    raise RuntimeError(f"cannot send {type(msg).__name__} to the node: {e}") from e

    def deliver(self, items: list[tuple[str, Event]]) -> None:
        """An engine-loop iteration's events: one message to the node. Protobuf messages travel
        serialized (the generated classes do not pickle by module path)."""
        self.send(Events([(rid, item.SerializeToString() if isinstance(item, pb.DecodeEvent) else item)
                          for rid, item in items]))

    def fail(self, why: str) -> None:
        self.failure = why

    def confirm(self, prefill_address: str, request_id: str) -> bool:
        return self.confirmer(prefill_address, request_id)

    def wave_started(self, wave: int) -> None:
        self.send(WaveStarted(wave))


def _pickles(item: object) -> bool:
    if item is None or isinstance(item, bytes):
        return True
    try:
        pickle.dumps(item)
        return True
    except Exception:
        return False


def serve_replica(ctx: RankContext) -> None:
    """Body of a replica process: build the replica, then relay the node's commands until ``Stop``."""
    from kv_transfer.transports.mooncake import MooncakeTransport

    spec: ReplicaSpec = ctx.payload
    link = _Link(ctx)
    ep = None
    if spec.expert_parallel:  # (collective: every replica process joins, before anything else of the world)
        experts = ModelConfig.from_pretrained(spec.config.model).n_routed_experts
        if not experts:
            raise ValueError("enable_expert_parallel: the model has no routed experts")
        ep = ExpertGroup.join(experts)
    transport = MooncakeTransport(host=spec.transfer_host, protocol=spec.kv_protocol)
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
    replica = Replica(spec.index, spec.config, transport, spec.timeout_s, pool, link, ep)
    link.send(ReplicaUp(replica.engine.max_model_len, replica.load.free_blocks,
                        replica.engine.model.routed_expert_params()))
    last: object = None
    try:
        while True:
            if ctx.conn.poll(REPORT_EVERY_S):
                msg = ctx.conn.recv()
                match msg:
                    case Start() | Abort() | AbortAll() | Wake():
                        replica.send(msg)
                    case Stop():
                        return
                    case _:
                        raise TypeError(f"unknown message {msg!r}")
            if link.failure is not None:  # after the events it emitted before it failed (on the pipe already)
                raise RuntimeError(link.failure)
            report = LoadReport(replica.load, replica.stats.totals())
            events = replica.take_kv_events()
            if report != last or events[0] or events[1]:
                link.send(LoadReport(report.load, report.transfers, events))
                last = report
    finally:
        replica.request_stop()
        replica.join()
        pool.shutdown(wait=True, cancel_futures=True)
        transport.close()
        link.confirmer.close()


# -- the node's side -------------------------------------------------------------------------------
def _parse(item: Any) -> Event:
    """An ``Events`` item as the stream takes it: a ``DecodeEvent`` (or the exception it could not be
    parsed into), an exception, or None."""
    if not isinstance(item, bytes):
        return item
    try:
        return pb.DecodeEvent.FromString(item)
    except Exception as e:
        return RuntimeError(f"a decode event did not parse: {e}")


class ProcessReplica:
    """A replica process as the node sees it (a ``decode_node.worker.ReplicaHandle``): ``send`` over its
    pipe, and its last reported load, transfer totals and prefix cache events."""

    def __init__(self, index: int, processes: ReplicaProcesses) -> None:
        self.index = index
        self._processes = processes
        self.load = ReplicaLoad(dp_rank=index)
        self._transfers: Totals = (0, 0, 0.0, {})
        self._kv_events: dict[int, bool] = {}  # prefix cache: hash -> stored (True) or evicted, not yet taken

    def send(self, command: object) -> None:
        self._processes.send(self.index, command)

    def transfers(self) -> Totals:
        return self._transfers

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        events, self._kv_events = self._kv_events, {}
        return split_events(events)

    def report(self, msg: LoadReport) -> None:
        self.load = msg.load
        self._transfers = msg.transfers
        stored, removed = msg.kv_events
        self._kv_events.update(dict.fromkeys(stored, True))
        self._kv_events.update(dict.fromkeys(removed, False))


Relay = Callable[[int, list[tuple[str, Event]]], None]  # (replica, its events): onto the requests' streams
Fail = Callable[[int | None, str], None]  # (the replica that failed, None: the pipes cannot tell which; why)


class ReplicaProcesses:
    """Starts the replica processes, hands their events and failures to ``relay`` / ``fail`` (from a
    reader thread), stops them."""

    def __init__(self, configs: list[EngineConfig], gpus: list[int] | None, transfer_host: str, kv_protocol: str,
                 timeout_s: float, start_timeout_s: float, relay: Relay, fail: Fail,
                 expert_parallel: bool = False) -> None:
        """``expert_parallel``: the replicas are one EP group (a ``torch.distributed`` world whose collectives
        time out after ``start_timeout_s``, the engine's ``rank_timeout_s``; their start waits at least
        ``STARTUP_MIN_S``)."""
        self._relay = relay
        self._fail = fail
        specs = [ReplicaSpec(d, c, transfer_host, kv_protocol, timeout_s, expert_parallel)
                 for d, c in enumerate(configs)]
        backend = ("nccl" if gpus else "gloo") if expert_parallel else None
        c0 = configs[0]
        self.group = RankGroup(serve_replica, len(specs), specs, backend=backend, host=c0.dist_host, port=c0.dist_port,
                               collective_timeout_s=start_timeout_s, gpus=gpus)
        self.replicas = [ProcessReplica(d, self) for d in range(len(specs))]
        self._lock = threading.Lock()  # the pipes' sends
        self._stopping = False
        start_timeout_s = max(start_timeout_s, STARTUP_MIN_S)
        self.group.start(ready_timeout_s=start_timeout_s)
        try:
            ups = [self._expect_up(d, start_timeout_s) for d in range(len(specs))]
        except BaseException:
            self.group.shutdown()
            raise
        self.max_model_len = ups[0].max_model_len
        self.num_blocks = ups[0].num_blocks
        self.expert_params = [up.expert_params for up in ups]
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
        with self._lock:
            try:
                self.group.send(d, msg)
            except RankFailure as e:
                self._fail(None, str(e))

    def _read(self) -> None:
        while not self._stopping:
            try:
                for d, msg in self.group.recv_ready(0.5):
                    self._dispatch(d, msg)
            except Exception as e:  # a dead replica, or anything else: no event would be read again
                if not self._stopping:
                    self._fail(None, str(e) if isinstance(e, RankFailure) else f"{type(e).__name__}: {e}")
                return

    def _dispatch(self, d: int, msg: object) -> None:
        match msg:
            case Events(items):
                self._relay(d, [(rid, _parse(item)) for rid, item in items])
            case LoadReport():
                self.replicas[d].report(msg)
            case WaveStarted(wave):
                for other in self.replicas:
                    if other.index != d:
                        other.send(Wake(wave))
            case _:
                log.warning("replica %d sent an unknown message %r", d, msg)

    def pids(self) -> list[int]:
        return self.group.pids()

    def shutdown(self) -> None:
        self._stopping = True
        self.group.shutdown(grace_s=10.0, why="the decode node stopped")
        self._reader.join(timeout=5.0)
