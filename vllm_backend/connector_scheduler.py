"""``PdKVConnector``'s scheduler half: it decides, per request, what is loaded and what is held.

It runs in vLLM's scheduler (EngineCore) process and never touches KV memory. Consumer: it tells
vLLM how many prompt tokens a ``do_remote_prefill`` request loads, and queues a ``RecvJob`` once
vLLM has allocated their blocks. Producer: it keeps a finished ``do_remote_decode`` request's
blocks and answers the ``kv_transfer_params`` a consumer pulls with, and serves the engine's worker
table on the side channel. What it decided reaches the workers as ``PdConnectorMetadata``
(``build_connector_meta``). The lifecycle is in ``vllm_backend.connector``'s docstring.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

from vllm_backend import side_channel
from vllm_backend.connector_meta import (
    REQUIRED,
    ConnectorSettings,
    EngineIdentity,
    PdConnectorMetadata,
    RecvJob,
    WorkerTable,
    loadable,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = init_logger(__name__)


class PdConnectorScheduler:
    """The scheduler-role half of ``PdKVConnector`` (one per engine)."""

    def __init__(self, settings: ConnectorSettings, me: EngineIdentity) -> None:
        self.settings = settings
        self.me = me
        self._local_hit: dict[str, int] = {}  # request -> positions vLLM found locally (load after them)
        self._pending = PdConnectorMetadata()  # what the next build_connector_meta hands the workers
        self._table: list[dict[str, Any]] = []  # this DP engine's workers, by rank (served as is)
        self._server: side_channel.SideChannelServer | None = None

    # -- handshake: the workers' layouts, served on the side channel (producer) --------------------

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Keep every worker's layout and (producer) serve it on the side channel."""
        workers: dict[int, dict[str, Any]] = {}
        for table in metadata.values():
            if isinstance(table, WorkerTable):
                workers.update({w.rank: asdict(w) for w in table.workers if w.dp == self.me.dp})
        self._table = [workers[r] for r in sorted(workers)]
        if self.me.is_producer and self._server is None:
            port = self.settings.side_channel_port + self.me.dp
            self._server = side_channel.SideChannelServer(self.settings.side_channel_host, port, self._serve)
            logger.info("PdKVConnector %s: side channel on %s", self.me.engine_id, self._server.address)

    def _serve(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") != "layout":
            raise ValueError(f"unknown op {req.get('op')!r}")
        return {"engine_id": self.me.engine_id, "workers": self._table}

    # -- consumer: what to load ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and loadable(params):
            # The producer's KV covers its prompt: a decode node that appends the first token the
            # prefill sampled (cluster nodes do) loads the prompt and computes that token here.
            n = len(request.prompt_token_ids or [])
            held = params.get("remote_num_tokens")
            if isinstance(held, int) and 0 < held < n:
                n = held
            count = n - num_computed_tokens
            if count > 0:
                self._local_hit[request.request_id] = num_computed_tokens
                return count, True  # True: asynchronously, vLLM waits for finished_recving
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        if not loadable(params):
            logger.warning("request %s: kv_transfer_params lack %s; computing locally", request.request_id,
                           [k for k in REQUIRED if k not in params])
            return
        start = self._local_hit.pop(request.request_id, 0)
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        # num_external_tokens == 0 (a full local hit): nothing to load, but the producer is still told
        self._pending.recv.append(RecvJob(request.request_id, dict(params), list(ids), start,
                                          start + num_external_tokens))

    def build_connector_meta(self) -> PdConnectorMetadata:
        meta, self._pending = self._pending, PdConnectorMetadata()
        return meta

    # -- both roles: a request ends -------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until the workers report the request finished sending, params to answer)."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._local_hit.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # finished (aborted) before its load: release the producer
            params["do_remote_prefill"] = False
            if all(k in params for k in REQUIRED):  # (a native node's lease frees its handle's blocks)
                self._pending.recv.append(RecvJob(request.request_id, dict(params), [], 0, 0))
            return False, None
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: free now
        self._pending.send.append(request.request_id)
        me, s = self.me, self.settings
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": me.engine_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": s.side_channel_host,
            "remote_port": s.side_channel_port + me.dp,
            "remote_dp_rank": me.dp,
            "remote_num_tokens": request.num_computed_tokens,
            "transfer_id": f"{me.engine_id}/{request.request_id}",
        }

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
