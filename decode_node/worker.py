"""The decode node's engine side: its DP replicas, and the streams of the requests they serve.

Each replica (``decode_node.replica.Replica``: an engine loop, its pulls, its requests' events) runs
as a thread of this process or in a process of its own (``decode_node.replica_process``;
``NodeConfig.dp_processes``). The node sees either through a ``ReplicaHandle``: commands in
(``send``: ``node_runtime.commands``), its last load, transfer totals and prefix cache events out.
What a replica emits comes back to ``DecodeWorker.relay`` as (request id, event) pairs, from the
replica's engine thread or from the pipes' reader thread, and goes onto each request's ``Stream``:
its sink, on its event loop (one wake-up of each loop per hand-over: ``decode_node.outbox``).

Threads share this process's Mooncake engine and confirmer; each process has its own. Threads exist
beside processes for two reasons: a tiny model on CPU needs no interpreter lock of its own per
replica, and the fake transport's fabric (fault-injection tests) lives in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cluster.config import NodeConfig
from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from decode_node.outbox import to_loops
from decode_node.replica import Event, Job, Replica
from decode_node.replica_process import ReplicaProcesses
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.fp8_compute import weights_held
from engine.parallel.expert_parallel import expert_shard
from kv_transfer.handoff import Totals, add_totals
from kv_transfer.protocol import choose_protocol
from kv_transfer.transport import Transport
from node_runtime.commands import Abort, AbortAll, Start
from node_runtime.confirm import PrefillConfirmer

log = logging.getLogger("pdcluster.decode")

Confirm = Callable[[str, str], bool]  # (prefill address, request id) -> the prefill node still held the KV


@dataclass
class Stream:
    """Where a request's events go: ``sink`` is called on ``loop``'s thread with each event (a
    ``pb.DecodeEvent``), then None at the end or the exception that failed the request."""

    request_id: str
    replica: int
    loop: asyncio.AbstractEventLoop
    sink: Callable[[Any], None]


class ReplicaHandle(Protocol):
    """A replica as the node sees it, whether a thread of this process or a process of its own."""

    index: int

    @property
    def load(self) -> ReplicaLoad:
        """As last published."""
        ...

    def send(self, command: object) -> None: ...

    def transfers(self) -> Totals: ...

    def take_kv_events(self) -> tuple[list[int], list[int]]: ...


class _ThreadOwner:
    """A thread replica's owner (``decode_node.replica.ReplicaOwner``): the worker, for replica ``index``."""

    def __init__(self, worker: DecodeWorker, index: int, confirm: Confirm) -> None:
        self._worker = worker
        self._index = index
        self.confirm = confirm

    def deliver(self, items: list[tuple[str, Event]]) -> None:
        self._worker.relay(self._index, items)

    def fail(self, why: str) -> None:
        self._worker.replica_failed(self._index, why)

    def wave_started(self, wave: int) -> None:
        raise RuntimeError("expert parallelism runs a decode node's replicas as processes, not threads")


class ThreadReplica:
    """A replica on a thread of this process (a ``ReplicaHandle``)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.index = replica.index

    @property
    def load(self) -> ReplicaLoad:
        return self.replica.load

    def send(self, command: object) -> None:
        self.replica.send(command)

    def transfers(self) -> Totals:
        return self.replica.stats.totals()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        return self.replica.take_kv_events()


class DecodeWorker:
    """The node's replicas: threads sharing one transport (Mooncake on ``transfer_host`` unless one is
    given), or processes with one each (``NodeConfig.dp_processes``)."""

    def __init__(self, config: NodeConfig, transfer_host: str, transport: Transport | None = None,
                 confirm: Confirm | None = None) -> None:
        """``confirm(prefill_address, request_id)``: the Release call after a pull (default: gRPC)."""
        self.config = config
        ec = config.engine
        on_gpu = ec.torch_device().type == "cuda"
        gpus = ec.gpu_ids(ec.dp) if on_gpu else []
        if gpus and max(gpus) >= torch.cuda.device_count():
            source = f"gpus {ec.gpus}" if ec.gpus else f"device {ec.device}"
            raise ValueError(f"dp={ec.dp} needs GPUs {gpus} (from {source}), {torch.cuda.device_count()} visible")
        # Replica d on GPU gpus[d] (--gpus 2,3; or --device cuda:K: K, K+1, ...).
        configs = [dataclasses.replace(ec, dp=1, device=f"cuda:{gpus[d]}" if on_gpu else ec.device, gpus=None,
                                       seed=ec.seed + d) for d in range(ec.dp)]
        mc = ModelConfig.from_pretrained(ec.model)
        expert_shard(ec, mc)  # experts that do not divide over the replicas: refused before they start
        self.vocab_size = mc.vocab_size
        self.routed_experts = mc.n_routed_experts or 0
        self.block_size = ec.block_size
        self.kv_cache_dtype = ec.kv_format(mc).wire_name  # a handle of another format is refused
        self.weights = weights_held(mc.quantization is not None, ec.torch_dtype(mc.torch_dtype),
                                    configs[0].torch_device())
        self.prefix_caching = ec.enable_prefix_caching
        self.address = ""  # set once the server listens
        self.failed = threading.Event()
        self.failure: str | None = None
        self.kv_protocol = choose_protocol(config.kv_protocol, on_gpu, transfer_host)
        self._streams: dict[str, Stream] = {}  # the requests in flight on every replica
        self._lock = threading.Lock()  # the streams: the event loop and the relaying threads
        self._per_replica = [0] * ec.dp  # streams per replica
        self._processes: ReplicaProcesses | None = None
        self._threads: list[Replica] = []
        if transport is None:
            log.info("KV transport: Mooncake %s on %s", self.kv_protocol, transfer_host)
        # Expert parallelism across the replicas: they are one torch.distributed world, so processes.
        ep = ec.enable_expert_parallel and ec.dp > 1
        if config.dp_processes == "on" or (config.dp_processes == "auto" and (on_gpu or ep)):
            if transport is not None or confirm is not None:
                raise ValueError("decode replicas in processes use their own transport and confirmer")
            self._processes = ReplicaProcesses(configs, gpus or None, transfer_host, self.kv_protocol,
                                               config.transfer_timeout_s, ec.rank_timeout_s, self.relay,
                                               self.replica_failed, expert_parallel=ep)
            self.replicas: list[ReplicaHandle] = list(self._processes.replicas)
            self.max_model_len = self._processes.max_model_len
            self.num_blocks = self._processes.num_blocks
            self.expert_params = self._processes.expert_params  # per replica
            return
        self._start_threads(configs, transfer_host, transport, confirm)

    def _start_threads(self, configs: list[EngineConfig], transfer_host: str, transport: Transport | None,
                       confirm: Confirm | None) -> None:
        if transport is None:
            from kv_transfer.transports.mooncake import MooncakeTransport

            transport = MooncakeTransport(host=transfer_host, protocol=self.kv_protocol)
        self._transport = transport
        self._confirmer: PrefillConfirmer | None = None
        if confirm is None:
            confirm = self._confirmer = PrefillConfirmer()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
        try:
            for d, rc in enumerate(configs):
                owner = _ThreadOwner(self, d, confirm)
                self._threads.append(Replica(d, rc, transport, self.config.transfer_timeout_s, self._pool, owner))
        except BaseException:
            self.shutdown()
            raise
        self.replicas = [ThreadReplica(r) for r in self._threads]
        self.max_model_len = self._threads[0].engine.max_model_len
        self.num_blocks = self._threads[0].load.free_blocks
        self.expert_params = [r.engine.model.routed_expert_params() for r in self._threads]

    # -- the event loop's thread ---------------------------------------------------------------
    def submit(self, job: Job, dp_rank: int, loop: asyncio.AbstractEventLoop, sink: Callable[[Any], None]) -> None:
        """Decode ``job`` on replica ``dp_rank`` (-1: the least loaded); its events go to ``sink`` on
        ``loop``'s thread (``Stream``)."""
        rid = job.request_id
        d = dp_rank if dp_rank >= 0 else min(range(len(self.replicas)), key=self._cost)
        with self._lock:
            duplicate = rid in self._streams
            if not duplicate:  # a second one would take the first one's events
                self._streams[rid] = Stream(rid, d, loop, sink)
                self._per_replica[d] += 1
        if duplicate:
            loop.call_soon_threadsafe(sink, ValueError(f"request id {rid!r} is already in flight"))
            return
        self.replicas[d].send(Start(job))

    def _cost(self, d: int) -> tuple[int, int, int]:
        r = self.replicas[d].load
        return (r.running + r.waiting + self._per_replica[d], -r.free_blocks, d)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.replicas[stream.replica].send(Abort(request_id))

    def has(self, request_id: str) -> bool:
        return request_id in self._streams

    # -- the replicas' threads -----------------------------------------------------------------
    def relay(self, d: int, items: list[tuple[str, Event]]) -> None:
        """Replica ``d``'s events (one engine-loop iteration's, in order) onto their streams' event
        loops; a stream leaves the table at its end."""
        out: list[tuple[Stream, Event]] = []
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is None or stream.replica != d:
                    continue
                if item is None or isinstance(item, BaseException):
                    self._end(stream)
                out.append((stream, item))
        to_loops(out)

    def replica_failed(self, d: int | None, why: str) -> None:
        """Replica ``d`` (None: one the pipes could not tell) can serve nothing more: the node fails, and
        its requests' streams end with an error."""
        self.fail(why)
        with self._lock:
            gone = [s for s in self._streams.values() if d is None or s.replica == d]
            for s in gone:
                self._end(s)
        to_loops([(s, RuntimeError("the decode engine failed")) for s in gone])

    def _end(self, stream: Stream) -> None:
        del self._streams[stream.request_id]
        self._per_replica[stream.replica] -= 1

    def fail(self, why: str) -> None:
        self.failure = why
        self.failed.set()

    # -- the node (NodeWorker) -----------------------------------------------------------------
    def load(self) -> list[ReplicaLoad]:
        return [r.load for r in self.replicas]

    def in_flight(self) -> int:
        return len(self._streams)

    def take_kv_events(self) -> list[tuple[int, list[int], list[int]]]:
        return [(r.index, *r.take_kv_events()) for r in self.replicas]

    def abort_all(self, why: str) -> None:
        for r in self.replicas:
            r.send(AbortAll(why))

    def stats_pb(self) -> tuple[list[pb.ReplicaStats], pb.TransferTotals]:
        reps = [pb.ReplicaStats(dp_rank=r.load.dp_rank, waiting=r.load.waiting, running=r.load.running,
                                used_blocks=r.load.used_blocks, free_blocks=r.load.free_blocks) for r in self.replicas]
        return reps, self.transfer_totals()

    def transfer_totals(self) -> pb.TransferTotals:
        done, nbytes, secs, fails = self.transfers()
        return pb.TransferTotals(done=done, bytes=nbytes, seconds=secs, failures=fails)

    def transfers(self) -> Totals:
        """Every replica's pulls: done, bytes, seconds, failures by cause."""
        return add_totals([r.transfers() for r in self.replicas])

    def pids(self) -> list[int]:
        """The replica processes' pids (none in thread mode)."""
        return self._processes.pids() if self._processes is not None else []

    def shutdown(self) -> None:
        if self._processes is not None:
            self._processes.shutdown()
            return
        for r in self._threads:  # all at once: each may be in the middle of a step
            r.request_stop()
        for r in self._threads:
            r.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._transport.close()
        if self._confirmer is not None:
            self._confirmer.close()
