"""The decode node's engine side: DP replicas with continuous batching, KV pulled from prefill ranks.

Request lifecycle (SGLang-style queues, one replica):

1. **Transfer**: ``submit`` hands over a request prefilled elsewhere. On the replica's engine
   thread its prompt blocks are allocated (``begin_prefilled``); the pull from the prefill ranks
   runs on a transfer thread, so the running batch keeps stepping meanwhile.
2. **Confirm, then admit**: when the pull is done the transfer thread confirms to the prefill
   node (``Release``; ``found=False`` means its lease ran out and the blocks may have been reused
   mid-read, so the request fails). Then the request joins the running batch between two steps
   (``admit_prefilled``) and the client hears ``Admitted``.
3. **Run**: every step's new tokens go to the request's stream; the last event has the finish
   reason. Aborts (client gone, node stopping) free the blocks between steps.

The receiver side of the KV hand-off (pull limit, confirmation, ``KVLost``) is
``kv_transfer.handoff``. A pull that fails keeps its blocks allocated for one more timeout period
(quarantine) before they are reused: Mooncake cannot cancel a batch, so after a timeout, or when
one source failed while batches to the others were in flight, late bytes may still land. Each
replica's engine thread is a ``node_runtime.engine_loop.EngineLoop`` with the messages below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.config import NodeConfig
from cluster.nodes import ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from decode_node.outbox import Item, Outbox, to_loops
from decode_node.replica_process import RemoteReplica, ReplicaProcesses
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.handle import KVSource
from kv_transfer.handoff import KVLost, KVReceiver, TransferStats
from kv_transfer.protocol import choose_protocol
from kv_transfer.transport import TransferError, Transport, register_cache
from node_runtime.engine_loop import EngineLoop

log = logging.getLogger("pdcluster.decode")


class NodeStopping(RuntimeError):
    """The node aborted the request because it is shutting down."""


@dataclass
class DecodeJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first: pb.Token  # sampled by the prefill node (unset with a local prefill)
    source: KVSource | None  # None: the replica prefills the prompt itself (DecodeRequest.local_prefill)
    loop: asyncio.AbstractEventLoop | None
    # Called on ``loop``'s thread with each of the request's events: a pb.DecodeEvent, then None (the
    # end) or an exception (``DecodeService``: a stream's queue, or the mux's queue directly).
    sink: Callable[[Any], None] | None
    seq: Sequence | None = None
    sent: int = 1  # output tokens already known to the client (the first came from prefill)
    admitted: bool = False  # the pull is done and the request is in the running batch
    cancelled: bool = False
    replica: int = -1
    t_submit: float = field(default_factory=time.monotonic)
    # admission's phases (time.monotonic): the engine thread took it, the pull ended, the prefill node confirmed
    t_started: float = 0.0
    t_pulled: float = 0.0
    t_confirmed: float = 0.0

    def emit(self, item: Any) -> None:
        """One event, from any thread (the engine thread buffers its events: ``Replica.outbox``)."""
        assert self.loop is not None and self.sink is not None
        self.loop.call_soon_threadsafe(self.sink, item)


# -- a replica's engine-thread messages ------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    job: DecodeJob


@dataclass(frozen=True)
class Pulled:
    """A pull ended (from a transfer thread): the block table, or why it failed."""

    job: DecodeJob
    table: list[int] | None
    error: BaseException | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    why: str


class Replica(EngineLoop):
    """One DP replica: an engine on its own thread (and device), and its pulls."""

    def __init__(self, index: int, config: EngineConfig, transport: Transport, stats: TransferStats,
                 timeout_s: float, pool: ThreadPoolExecutor, worker: DecodeWorker) -> None:
        super().__init__(f"decode-engine-{index}")
        self.index = index
        self.engine = LLMEngine(config)
        dest = register_cache(transport, self.engine.cache_layers)
        self.receiver = KVReceiver(transport, dest, timeout_s=timeout_s, stats=stats)
        self.timeout_s = timeout_s
        self.pool = pool
        self.worker = worker
        self.outbox = Outbox(worker.deliver)  # the requests' events, handed over once per loop iteration
        self.jobs: dict[str, DecodeJob] = {}  # transferring or running
        self.quarantine: list[tuple[float, str]] = []  # (free after, request id)
        self.load = ReplicaLoad(dp_rank=index, free_blocks=self.engine.scheduler.allocator.num_free)
        self.start()

    # -- the engine thread ---------------------------------------------------------------------
    def handle(self, message: object) -> None:
        match message:
            case Start(job):
                self._start(job)
            case Pulled(job, table, error):
                self._admit(job, table, error)
            case Abort(rid):
                self._abort(rid)
            case AbortAll(why):
                for rid in list(self.jobs):
                    self._abort(rid, NodeStopping(f"request {rid} aborted: {why}"))
            case _:
                raise TypeError(f"unknown message {message!r}")

    def step(self) -> int:
        self._free_quarantined()
        if not self.engine.has_unfinished():
            return 0
        scheduled = self.engine.launch_step()
        self.engine.finish_step()
        self._emit_tokens()
        return scheduled

    def on_failure(self, error: BaseException) -> None:
        try:  # what the iteration emitted before it failed goes first: finished requests keep their ends
            self.outbox.flush()
        except Exception:
            log.exception("replica %d: events emitted before the failure were lost", self.index)
        self.worker.fail(f"replica {self.index}: {type(error).__name__}: {error}")
        for job in self.jobs.values():
            self.outbox.put(job, RuntimeError("the decode engine failed"))
        self.jobs.clear()
        self.outbox.flush()

    def flush(self) -> None:
        self.outbox.flush()

    def _start(self, job: DecodeJob) -> None:
        source = job.source
        if source is None:
            self._start_local(job)
            return
        try:
            job.seq = self.engine.begin_prefilled(job.prompt, job.params, request_id=job.request_id)
        except (ValueError, TypeError, MemoryError) as e:
            self.outbox.put(job, e)
            return
        job.replica = self.index
        job.t_started = time.monotonic()
        self.jobs[job.request_id] = job
        hit = job.seq.prefix_hit_blocks  # cached here already (prefix caching): not pulled
        have, blocks = job.seq.block_ids[:hit], job.seq.block_ids[hit:]

        def pull() -> None:
            try:
                # The prefill node frees the blocks when its lease runs out, even mid-pull.
                limit = self.receiver.limit(source.lease_s, job.t_submit)
                table = have + self.receiver.fill(job.request_id, source.request, source.layouts, limit)(blocks)
                job.t_pulled = time.monotonic()
                confirmed = self.worker.confirm(source.prefill_address, job.request_id)
                job.t_confirmed = time.monotonic()
                if not confirmed:
                    raise KVLost(f"{source.prefill_node_id} no longer held the KV of {job.request_id} "
                                 "(lease expired or aborted during the pull)")
                self.send(Pulled(job, table, None))
            except BaseException as e:
                self.send(Pulled(job, None, e))

        self.pool.submit(pull)

    def _start_local(self, job: DecodeJob) -> None:
        """Prefill here (colocated serving): the request joins the scheduler like any other; every token,
        the first too, goes out as the steps make them."""
        try:
            job.seq = self.engine.add_request(job.prompt, job.params, request_id=job.request_id)
        except (ValueError, TypeError, MemoryError) as e:
            self.outbox.put(job, e)
            return
        job.replica = self.index
        job.sent = 0
        job.admitted = True
        self.jobs[job.request_id] = job
        self.outbox.put(job, pb.DecodeEvent(admitted=pb.Admitted(dp_rank=self.index)))

    def _admit(self, job: DecodeJob, table: list[int] | None, error: BaseException | None) -> None:
        rid = job.request_id
        if error is not None or job.cancelled:
            self.jobs.pop(rid, None)
            if isinstance(error, TransferError):
                self.quarantine.append((time.monotonic() + self.timeout_s, rid))  # late bytes may land
            else:
                self.engine.abort(rid)
            self.outbox.put(job, error if error is not None else RuntimeError(f"request {rid} aborted"))
            return
        assert table is not None and job.seq is not None
        rec = self.receiver.stats.last(rid)
        first = job.first
        top = {t.token_id: t.logprob for t in first.top} or None
        try:
            done = self.engine.admit_prefilled(job.seq, table, first.token_id, first.logprob, top)
        except (ValueError, KeyError) as e:
            self.jobs.pop(rid, None)
            self.engine.abort(rid)
            self.outbox.put(job, e)
            return
        job.admitted = True
        if log.isEnabledFor(logging.DEBUG):
            ms = [1000 * (b - a) for a, b in ((job.t_submit, job.t_started), (job.t_started, job.t_pulled),
                                               (job.t_pulled, job.t_confirmed), (job.t_confirmed, time.monotonic()))]
            log.debug("admitted %s after %.1f ms: to the engine thread %.1f, pull %.1f, confirm %.1f, to admission "
                      "%.1f", rid, sum(ms), *ms)
        self.outbox.put(job, pb.DecodeEvent(admitted=pb.Admitted(
            dp_rank=self.index, transfer_bytes=rec.bytes if rec else 0, transfer_s=rec.seconds if rec else 0.0,
            cached_tokens=job.seq.prefix_hit_blocks * self.engine.config.block_size)))
        if done:
            self._finish(job)

    def _emit_tokens(self) -> None:
        for job in list(self.jobs.values()):
            seq = job.seq
            if seq is None or not job.admitted:
                continue
            n = len(seq.output_token_ids)
            if n > job.sent:
                toks = [token_pb(seq.output_token_ids[i], seq.logprobs[i] if i < len(seq.logprobs) else None,
                                 seq.top_logprobs[i] if i < len(seq.top_logprobs) else None)
                        for i in range(job.sent, n)]
                job.sent = n
                if seq.is_finished:
                    self._finish(job, toks)
                else:
                    self.outbox.put(job, pb.DecodeEvent(tokens=pb.Tokens(tokens=toks)))
            elif seq.is_finished:
                self._finish(job)

    def _finish(self, job: DecodeJob, toks: list[pb.Token] | None = None) -> None:
        assert job.seq is not None
        self.jobs.pop(job.request_id, None)
        finish = job.seq.finish_reason or "stop"
        self.outbox.put(job, pb.DecodeEvent(tokens=pb.Tokens(tokens=toks or [], finish_reason=finish)))
        self.outbox.put(job, None)

    def _abort(self, rid: str, why: BaseException | None = None) -> None:
        job = self.jobs.get(rid)
        if job is None:
            return
        if not job.admitted:
            job.cancelled = True  # still pulling: freed when the pull returns (its bytes may still land)
            return
        self.jobs.pop(rid, None)
        self.engine.abort(rid)
        self.outbox.put(job, why or RuntimeError(f"request {rid} aborted"))

    def _free_quarantined(self) -> None:
        now = time.monotonic()
        keep = []
        for until, rid in self.quarantine:
            if until <= now:
                self.engine.abort(rid)
            else:
                keep.append((until, rid))
        self.quarantine = keep

    def publish(self) -> None:
        s = self.engine.scheduler
        self.load = ReplicaLoad(dp_rank=self.index, waiting=len(s.waiting), running=len(s.running),
                                used_blocks=self.engine.num_used_blocks, free_blocks=s.allocator.num_free,
                                **self.engine.prefix_cache_counts())


class DecodeWorker:
    """The node's replicas: threads sharing one transport (Mooncake on ``transfer_host`` unless one is
    given), or processes with one each (``decode_node.replica_process``; ``NodeConfig.dp_processes``)."""

    def __init__(self, config: NodeConfig, transfer_host: str, transport: Transport | None = None,
                 confirm: Callable[[str, str], bool] | None = None) -> None:
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
        self.vocab_size = ModelConfig.from_pretrained(ec.model).vocab_size
        self.block_size = ec.block_size
        self.prefix_caching = ec.enable_prefix_caching
        self.address = ""  # set once the server listens
        self.failed = threading.Event()
        self.failure: str | None = None
        self.processes: ReplicaProcesses | None = None
        self.kv_protocol = choose_protocol(config.kv_protocol, on_gpu, transfer_host)
        if transport is None:
            log.info("KV transport: Mooncake %s on %s", self.kv_protocol, transfer_host)
        use_processes = config.dp_processes == "on" or (config.dp_processes == "auto" and on_gpu)
        if use_processes:
            if transport is not None or confirm is not None:
                raise ValueError("decode replicas in processes use their own transport and confirmer")
            self.processes = ReplicaProcesses(self, configs, gpus or None, transfer_host,
                                              self.kv_protocol, config.transfer_timeout_s, ec.rank_timeout_s)
            self.replicas: list[Replica] | list[RemoteReplica] = self.processes.replicas
            self.max_model_len = self.processes.max_model_len
            self.num_blocks = self.processes.num_blocks
            return
        if confirm is None:
            from node_runtime.confirm import PrefillConfirmer

            confirm = PrefillConfirmer()
        self.confirm = confirm
        if transport is None:
            from kv_transfer.transports.mooncake import MooncakeTransport

            transport = MooncakeTransport(host=transfer_host, protocol=self.kv_protocol)
        self.transport = transport
        self.stats = TransferStats()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
        threads: list[Replica] = []
        self.replicas = threads
        try:
            for d, rc in enumerate(configs):
                threads.append(Replica(d, rc, self.transport, self.stats, config.transfer_timeout_s, self.pool, self))
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = threads[0].engine.max_model_len
        self.num_blocks = threads[0].load.free_blocks

    def submit(self, job: DecodeJob, dp_rank: int) -> None:
        d = dp_rank if dp_rank >= 0 else min(range(len(self.replicas)), key=self._cost)
        self.replicas[d].send(Start(job))

    def _cost(self, d: int) -> tuple[int, int, int]:
        r = self.replicas[d].load
        return (r.running + r.waiting + len(self.replicas[d].jobs), -r.free_blocks, d)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.send(Abort(request_id))

    def fail(self, why: str) -> None:
        self.failure = why
        self.failed.set()

    def deliver(self, items: list[Item]) -> None:
        """A replica thread's events: onto the requests' event loops."""
        to_loops(items)

    def load(self) -> list[ReplicaLoad]:
        return [r.load for r in self.replicas]

    def in_flight(self) -> int:
        return sum(len(r.jobs) for r in self.replicas)

    def take_kv_events(self) -> list[tuple[int, list[int], list[int]]]:
        return [(r.index, *(r.engine.take_kv_events() if isinstance(r, Replica) else r.take_kv_events()))
                for r in self.replicas]

    def abort_all(self, why: str) -> None:
        for r in self.replicas:
            r.send(AbortAll(why))

    def stats_pb(self) -> tuple[list[pb.ReplicaStats], pb.TransferTotals]:
        reps = [pb.ReplicaStats(dp_rank=r.load.dp_rank, waiting=r.load.waiting, running=r.load.running,
                                used_blocks=r.load.used_blocks, free_blocks=r.load.free_blocks) for r in self.replicas]
        if self.processes is not None:
            done, nbytes, secs, fails = self.processes.stats()
        else:
            s = self.stats
            done, nbytes, secs, fails = s.done, s.bytes, s.seconds, dict(s.failures)
        return reps, pb.TransferTotals(done=done, bytes=nbytes, seconds=secs, failures=fails)

    def pids(self) -> list[int]:
        """The replica processes' pids (none in thread mode)."""
        return self.processes.pids() if self.processes is not None else []

    def shutdown(self) -> None:
        if self.processes is not None:
            self.processes.shutdown()
            return
        threads = [r for r in self.replicas if isinstance(r, Replica)]
        for r in threads:  # all at once: each may be in the middle of a step
            r.request_stop()
        for r in threads:
            r.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.transport.close()
        close = getattr(self.confirm, "close", None)
        if close is not None:
            close()
