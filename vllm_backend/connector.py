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

vLLM makes one connector per role per process. ``PdKVConnector`` is a thin facade: each hook
delegates to the half for its role, ``PdConnectorScheduler`` (``vllm_backend.connector_scheduler``,
the scheduler process) or ``PdConnectorWorker`` (``vllm_backend.connector_worker``, every worker);
what passes between them is in ``vllm_backend.connector_meta``. The hand-off itself follows
``kv_transfer.handoff``: the producer's workers hold blocks in a ``KVSender``, the consumer's
workers read through a ``KVReceiver``.

Lifecycle, in call order (S = scheduler process, W = every worker):

Producer
  W ``register_kv_caches``      register every layer's cache with Mooncake; start a notify server.
  W ``get_handshake_metadata``  this worker's cache layout, all-gathered so each worker has every one.
  S ``set_xfer_handshake_metadata_pp_aware``  keep the table; serve it on the side channel
                                (``side_channel_host:side_channel_port + data_parallel_rank``).
  S ``request_finished``        a length-capped/stopped ``do_remote_decode`` request keeps its
                                blocks (returns True) and answers the params above.
  S ``build_connector_meta``    tells the workers which requests now await a reader.
  W ``start_load_kv``           each worker holds that request in its ``KVSender`` (lease ``lease_s``).
  W (notify server)             a consumer worker said "done"; when every one of them has (they say
                                how many they are), the sender ``confirm``s the request.
  W ``get_transfer_results``    ``expire``s leases past their deadline, then reports every request
                                the sender freed (confirmed or expired) as finished sending: exactly
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
                                (``vllm_backend.layout``), ``plan_transfer``, ``KVReceiver.pull``
                                (Mooncake ``read_all`` from every source, within ``pull_limit``),
                                then notify every producer worker.
  W ``get_transfer_results``    finished receives (failed ones too, with their blocks reported by
                                ``get_block_ids_with_load_errors`` so vLLM recomputes them).
  S ``request_finished``        a request aborted before its load still notifies the producer.

A native prefill node is a producer too: params carrying its ``KVHandle`` (``pd_handle``,
``vllm_backend.handle_params``) name every holder rank's blocks and cache directly, so the
pull thread plans from those (any native DP x PCP x PP, sharded or replicated) with no side channel
and no notification (the decode node releases the request on the prefill node); the handle's
``lease_s`` caps the read (``pull_limit``: half the lease, from when the worker got the load).

Pull, not push (``kv_transfer.handoff``): the consumer owns the destination blocks and knows when
they are allocated; the producer only holds blocks under a lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from vllm_backend.connector_meta import (
    ConnectorSettings,
    EngineIdentity,
    PdConnectorMetadata,
    RecvJob,
    WorkerTable,
)
from vllm_backend.connector_scheduler import PdConnectorScheduler
from vllm_backend.connector_worker import PdConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# What vLLM and older imports find here (the classes live in the halves' shared module).
__all__ = ["ConnectorSettings", "PdConnectorMetadata", "PdKVConnector", "RecvJob", "WorkerTable"]


class PdKVConnector(KVConnectorBase_V1):
    """See the module docstring for the lifecycle; one instance per role per process."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(dict(kt.kv_connector_extra_config or {}))
        par = vllm_config.parallel_config
        me = EngineIdentity(
            engine_id=str(kt.engine_id), dp=int(par.data_parallel_rank),
            is_producer=kt.is_kv_producer, is_consumer=kt.is_kv_consumer,
            parallel=dict(tp=par.tensor_parallel_size, pcp=par.prefill_context_parallel_size,
                          dcp=par.decode_context_parallel_size, pp=par.pipeline_parallel_size,
                          interleave=par.cp_kv_cache_interleave_size or 1))
        self.settings = settings
        self.engine_id = me.engine_id
        self.scheduler_half: PdConnectorScheduler | None = None
        self.worker_half: PdConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_half = PdConnectorScheduler(settings, me)
        else:
            self.worker_half = PdConnectorWorker(settings, me)

    # A hook of the other role is a vLLM bug, not a request's: fail loudly.
    @property
    def _sched(self) -> PdConnectorScheduler:
        if self.scheduler_half is None:
            raise RuntimeError("a scheduler hook was called on PdKVConnector's worker role")
        return self.scheduler_half

    @property
    def _work(self) -> PdConnectorWorker:
        if self.worker_half is None:
            raise RuntimeError("a worker hook was called on PdKVConnector's scheduler role")
        return self.worker_half

    # ============================== scheduler side ==============================

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched.set_xfer_handshake_metadata_pp_aware(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched.set_xfer_handshake_metadata_pp_aware({(0, k): v for k, v in metadata.items()})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work.get_handshake_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdConnectorMetadata)
        self._work.start_load_kv(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.get_block_ids_with_load_errors()

    # Layer-wise hooks: the KV moves whole, before the request is scheduled, so these do nothing.
    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.scheduler_half is not None:
            self.scheduler_half.shutdown()
        if self.worker_half is not None:
            self.worker_half.shutdown()
