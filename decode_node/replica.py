"""One decode DP replica: an engine on its own thread (and device), its KV pulls, its requests' events.

Request lifecycle (SGLang-style queues, one replica):

1. **Transfer**: ``Start(job)`` hands over a request prefilled elsewhere. On the engine thread its
   prompt blocks are allocated (``begin_prefilled``); the pull from the prefill ranks runs on a
   transfer thread, so the running batch keeps stepping meanwhile.
2. **Confirm, then admit**: when the pull is done the transfer thread confirms to the prefill node
   (``Release``; ``found=False`` means its lease ran out and the blocks may have been reused
   mid-read, so the request fails). Then the request joins the running batch between two steps
   (``admit_prefilled``) and the client hears ``Admitted``.
3. **Run**: every step's new tokens go to the request's stream; the last event has the finish
   reason. Aborts (client gone, node stopping) free the blocks between steps.

With speculative decoding, a request from a prefill node without it (its KV lacks the MTP layer's) pulls
nothing when ``mtp_recompute`` is on: the transfer thread releases the prefill node's lease at once, and
the engine computes the prompt (and the first token) again in the request's blocks, the MTP layer with
it, so the request drafts from the step after (``LLMEngine.admit_prefilled``); with it off the KV is pulled
and the request decodes without drafts. The replica logs which, once per prefill node.

A job without a KV source prefills here instead (colocated serving): it joins the scheduler like an
offline request, and every token, the first too, goes out as the steps make them.

The receiver side of the KV hand-off (pull limit, confirmation, ``KVLost``) is
``kv_transfer.handoff``. A pull that fails keeps its blocks allocated for one more timeout period
(quarantine) before they are reused: Mooncake cannot cancel a batch, so after a timeout, or when
one source failed while batches to the others were in flight, late bytes may still land.

The replica is the same whether it runs as a thread of the node's process or in a process of its
own (``decode_node.replica_process``): it takes ``node_runtime.commands`` (``Start`` with a ``Job``,
``Abort``, ``AbortAll``) through ``send``, and hands what one iteration of its engine loop emitted to
its ``ReplicaOwner`` as (request id, event) pairs, at once (``decode_node.outbox``).

Under expert parallelism (in processes only) the node's replicas are one EP group: each holds its share
of the routed experts and steps in lockstep with the others, by waves (``decode_node.waves``: a ``Wake``
from the node joins one).
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from decode_node.outbox import Outbox
from decode_node.waves import Wake, Waves
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.expert_parallel import ExpertGroup
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kv_transfer.handle import KVSource
from kv_transfer.handoff import KVLost, KVReceiver, TransferStats
from kv_transfer.transport import TransferError, Transport, register_cache
from node_runtime.commands import Abort, AbortAll, Start
from node_runtime.engine_loop import EngineLoop
from node_runtime.replica_load import replica_load

log = logging.getLogger("pdcluster.decode")

# What a request's stream gets: a pb.DecodeEvent, then None at the end, or the exception that failed it.
Event = pb.DecodeEvent | BaseException | None


class NodeStopping(RuntimeError):
    """The node aborted the request because it is shutting down."""


@dataclass(frozen=True)
class Job:
    """A request to decode, as the node hands it to a replica (it pickles: it crosses a replica process's
    pipe). The first token was sampled by the prefill node; with a local prefill (no ``source``) there is
    none yet."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    source: KVSource | None  # None: the replica prefills the prompt itself (DecodeRequest.local_prefill)
    first_token: int = 0
    first_logprob: float = math.nan
    first_top: dict[int, float] | None = None
    drafts: tuple[int, ...] = ()  # speculative decoding: the prefill node's drafts after the first token
    t_submit: float = field(default_factory=time.monotonic)  # system-wide on Linux: valid in another process


class ReplicaOwner(Protocol):
    """What a replica asks of whoever runs it: the node's worker (a thread), or a replica process's link."""

    def deliver(self, items: list[tuple[str, Event]]) -> None:
        """One engine-loop iteration's events, in order (called on the engine thread)."""

    def fail(self, why: str) -> None:
        """The engine failed: the replica serves nothing more (its events emitted before were delivered)."""

    def confirm(self, prefill_address: str, request_id: str) -> bool:
        """The Release call to the prefill node after a pull: False if it no longer held the KV."""

    def wave_started(self, wave: int) -> None:
        """This replica started EP wave ``wave``: every other replica of the node must join it (expert
        parallelism only)."""


@dataclass
class _Request:
    """A job on this replica: its engine request and what its stream has been sent."""

    job: Job
    seq: Sequence | None = None
    sent: int = 1  # output tokens already known to the client (the first came from prefill)
    admitted: bool = False  # the pull is done and the request is in the running batch
    cancelled: bool = False
    mtp_kv: bool = False  # the source's KV includes the MTP layer's (speculative decoding: the request drafts)
    recompute: bool = False  # it lacks it, and the prompt is computed again here for it: nothing is pulled
    # admission's phases (time.monotonic): the engine thread took it, the pull ended, the prefill node confirmed
    t_started: float = 0.0
    t_pulled: float = 0.0
    t_confirmed: float = 0.0


@dataclass(frozen=True)
class Pulled:
    """A pull ended (from a transfer thread): the block table, or why it failed."""

    request: _Request
    table: list[int] | None
    error: BaseException | None


class Replica(EngineLoop):
    """One DP replica: an engine on its own thread (and device), and its pulls (on ``pool``'s threads,
    through ``transport``)."""

    def __init__(self, index: int, config: EngineConfig, transport: Transport, timeout_s: float,
                 pool: ThreadPoolExecutor, owner: ReplicaOwner, ep: ExpertGroup | None = None) -> None:
        """``ep``: this replica's place in the node's EP group (its replicas step in lockstep)."""
        super().__init__(f"decode-engine-{index}")
        self.index = index
        self.engine = LLMEngine(config, ep=ep)
        self.waves = Waves(ep, owner.wave_started) if ep is not None else None
        self.stats = TransferStats()
        # The MTP layer's cache moves when both sides have it (speculative decoding on both).
        self.receiver = KVReceiver(transport, register_cache(transport, self.engine.cache_layers),
                                   timeout_s=timeout_s, stats=self.stats, optional=self.engine.mtp_layers)
        self.timeout_s = timeout_s
        self.no_mtp: set[str] = set()  # prefill nodes said (in the log) to send no MTP layer KV
        self.pool = pool
        self.owner = owner
        self.outbox = Outbox(owner.deliver)  # the requests' events, handed over once per loop iteration
        self.requests: dict[str, _Request] = {}  # transferring or running
        self.quarantine: list[tuple[float, str]] = []  # (free after, request id)
        self.load = replica_load(index, self.engine.load())
        self.start()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """Hashes the prefix cache stored and evicted since the last call (any thread)."""
        return self.engine.take_kv_events()

    # -- the engine thread ---------------------------------------------------------------------
    def handle(self, message: object) -> None:
        match message:
            case Start(job):
                self._start(job)
            case Pulled(request, table, error):
                self._admit(request, table, error)
            case Wake(wave) if self.waves is not None:
                self.waves.join(wave)
            case Abort(rid):
                self._abort(rid)
            case AbortAll(why):
                for rid in list(self.requests):
                    self._abort(rid, NodeStopping(f"request {rid} aborted: {why}"))
            case _:
                raise TypeError(f"unknown message {message!r}")

    def step(self) -> int:
        self._free_quarantined()
        busy = self.engine.has_unfinished()
        if not (self.waves.step_now(busy) if self.waves is not None else busy):
            return 0
        scheduled = self.engine.launch_step()
        self.engine.finish_step()
        self._emit_tokens()
        # In a wave the loop goes on at once while any replica had rows (the others wait in its collectives).
        return scheduled if self.waves is None else self.waves.group.rows

    def publish(self) -> None:
        self.load = replica_load(self.index, self.engine.load())

    def flush(self) -> None:
        self.outbox.flush()

    def on_failure(self, error: BaseException) -> None:
        try:  # what the iteration emitted before it failed goes first: finished requests keep their ends
            self.outbox.flush()
        except Exception:
            log.exception("replica %d: events emitted before the failure were lost", self.index)
        self.requests.clear()
        self.owner.fail(f"replica {self.index}: {type(error).__name__}: {error}")

    def _start(self, job: Job) -> None:
        request = _Request(job)
        try:
            if job.source is None:
                request.seq = self.engine.add_request(job.prompt, job.params, request_id=job.request_id)
            else:
                request.seq = self.engine.begin_prefilled(job.prompt, job.params, request_id=job.request_id)
        except (ValueError, TypeError, MemoryError) as e:
            self.outbox.put(job.request_id, e)
            return
        self.requests[job.request_id] = request
        if job.source is None:  # prefilled here: every token goes out as the steps make it
            request.sent = 0
            request.admitted = True
            self.outbox.put(job.request_id, pb.DecodeEvent(admitted=pb.Admitted(dp_rank=self.index)))
            return
        request.mtp_kv = any(self.engine.mtp_layers & set(h.layers) for h in job.source.request.holders)
        request.recompute = not request.mtp_kv and self.engine.recomputes_mtp_kv(request.seq)
        if not request.mtp_kv and self.engine.speculative is not None:
            self._say_no_mtp(job.source.prefill_node_id)
        request.t_started = time.monotonic()
        self.pool.submit(self._pull, request)

    def _say_no_mtp(self, prefill_node_id: str) -> None:
        """Log once per prefill node that its KV lacks the MTP layer's, and what this replica does then."""
        if prefill_node_id in self.no_mtp:
            return
        self.no_mtp.add(prefill_node_id)
        if self.engine.config.mtp_recompute:
            what = ("this replica computes the MTP layer's KV itself: it prefills the prompts of its requests "
                    "that can draft again instead of pulling their KV, and they draft from the step after "
                    "(mtp_recompute)")
        else:
            what = "its requests decode here without drafts (mtp_recompute is off)"
        log.info("replica %d: prefill node %s sends no MTP layer KV (its speculative_config is off): %s",
                 self.index, prefill_node_id, what)

    def _pull(self, request: _Request) -> None:
        """On a transfer thread: pull the KV not cached here, confirm, then hand the table back."""
        job, seq = request.job, request.seq
        assert job.source is not None and seq is not None
        source = job.source
        if request.recompute:  # its KV is computed here: nothing to pull, and the prefill node's lease ends now
            self._release_unpulled(request)
            return
        hit = seq.prefix_hit_blocks  # cached here already (prefix caching): not pulled
        try:
            # The prefill node frees the blocks when its lease runs out, even mid-pull.
            limit = self.receiver.limit(source.lease_s, job.t_submit)
            table = seq.block_ids[:hit] + self.receiver.pull_into(
                job.request_id, source.request, source.layouts, seq.block_ids[hit:], limit)
            request.t_pulled = time.monotonic()
            confirmed = self.owner.confirm(source.prefill_address, job.request_id)
            request.t_confirmed = time.monotonic()
            if not confirmed:
                raise KVLost(f"{source.prefill_node_id} no longer held the KV of {job.request_id} "
                             "(lease expired or aborted during the pull)")
            self.send(Pulled(request, table, None))
        except BaseException as e:
            self.send(Pulled(request, None, e))

    def _release_unpulled(self, request: _Request) -> None:
        """On a transfer thread: a request whose prompt is computed here again (``recompute``) releases the
        prefill node's blocks without reading them (whatever the answer: nothing was read), then joins."""
        job, seq = request.job, request.seq
        assert job.source is not None and seq is not None
        request.t_pulled = time.monotonic()
        try:
            self.owner.confirm(job.source.prefill_address, job.request_id)
        except Exception as e:  # its lease frees the blocks anyway
            log.warning("could not release %s on %s (%s); its lease will", job.request_id,
                        job.source.prefill_node_id, e)
        request.t_confirmed = time.monotonic()
        self.send(Pulled(request, list(seq.block_ids), None))

    def _admit(self, request: _Request, table: list[int] | None, error: BaseException | None) -> None:
        job = request.job
        rid = job.request_id
        if error is not None or request.cancelled:
            self.requests.pop(rid, None)
            if isinstance(error, TransferError):
                self.quarantine.append((time.monotonic() + self.timeout_s, rid))  # late bytes may land
            else:
                self.engine.abort(rid)
            self.outbox.put(rid, error if error is not None else RuntimeError(f"request {rid} aborted"))
            return
        assert table is not None and request.seq is not None
        rec = self.stats.last(rid)
        # Speculative decoding: the prefill node's drafts if the MTP layer's KV of the prompt came too; without
        # it the engine computes the prompt again (request.recompute: nothing was pulled) or decodes no drafts.
        drafts = list(job.drafts) if request.mtp_kv else None
        try:
            done = self.engine.admit_prefilled(request.seq, table, job.first_token, job.first_logprob, job.first_top,
                                               drafts)
        except (ValueError, KeyError) as e:
            self.requests.pop(rid, None)
            self.engine.abort(rid)
            self.outbox.put(rid, e)
            return
        request.admitted = True
        if log.isEnabledFor(logging.DEBUG):
            ms = [1000 * (b - a) for a, b in ((job.t_submit, request.t_started), (request.t_started, request.t_pulled),
                                               (request.t_pulled, request.t_confirmed),
                                               (request.t_confirmed, time.monotonic()))]
            log.debug("admitted %s after %.1f ms: to the engine thread %.1f, pull %.1f, confirm %.1f, to admission "
                      "%.1f", rid, sum(ms), *ms)
        self.outbox.put(rid, pb.DecodeEvent(admitted=pb.Admitted(
            dp_rank=self.index, transfer_bytes=rec.bytes if rec else 0, transfer_s=rec.seconds if rec else 0.0,
            cached_tokens=request.seq.prefix_hit_blocks * self.engine.config.block_size)))
        if done:
            self._finish(request)

    def _emit_tokens(self) -> None:
        for request in list(self.requests.values()):
            seq = request.seq
            if seq is None or not request.admitted:
                continue
            n = len(seq.output_token_ids)
            if n > request.sent:
                toks = [token_pb(seq.output_token_ids[i], seq.logprobs[i] if i < len(seq.logprobs) else None,
                                 seq.top_logprobs[i] if i < len(seq.top_logprobs) else None)
                        for i in range(request.sent, n)]
                request.sent = n
                if seq.is_finished:
                    self._finish(request, toks)
                else:
                    self.outbox.put(request.job.request_id, pb.DecodeEvent(tokens=pb.Tokens(tokens=toks)))
            elif seq.is_finished:
                self._finish(request)

    def _finish(self, request: _Request, toks: list[pb.Token] | None = None) -> None:
        assert request.seq is not None
        rid = request.job.request_id
        self.requests.pop(rid, None)
        finish = request.seq.finish_reason or "stop"
        self.outbox.put(rid, pb.DecodeEvent(tokens=pb.Tokens(tokens=toks or [], finish_reason=finish)))
        self.outbox.put(rid, None)

    def _abort(self, rid: str, why: BaseException | None = None) -> None:
        request = self.requests.get(rid)
        if request is None:
            return
        if not request.admitted:
            request.cancelled = True  # still pulling: freed when the pull returns (its bytes may still land)
            return
        self.requests.pop(rid, None)
        self.engine.abort(rid)
        self.outbox.put(rid, why or RuntimeError(f"request {rid} aborted"))

    def _free_quarantined(self) -> None:
        now = time.monotonic()
        keep = []
        for until, rid in self.quarantine:
            if until <= now:
                self.engine.abort(rid)
            else:
                keep.append((until, rid))
        self.quarantine = keep

