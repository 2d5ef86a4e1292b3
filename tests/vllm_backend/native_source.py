"""A native engine as the producer for a vLLM decode engine running ``PdKVConnector``.

Our native cache is vLLM's MLA layout (per layer ``[num_blocks, block_size, 576]``: normalised
``kv_c`` then rotated ``k_pe`` in interleaved pairs), so a single-rank native engine *is* a vLLM
engine with TP = PCP = DCP = 1 as far as the consumer can tell: this class serves the same side
channel a vLLM producer serves (``op: layout``, one worker) plus its notify op, and answers the
same ``kv_transfer_params``. When every consumer worker has said "done" the request's blocks are
freed through ``release`` (the engine's, or the node's lease), exactly once.

A native prefill *node* (any DP x PCP x PP) needs none of this: its ``KVHandle`` names the holders
per request and travels in the params (``vllm_backend.handle_params``). This class is for an
``engine.LLM`` used directly as a producer: a test fixture (``test_vllm_pd.py``), not a product path.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kv_transfer.layout import CacheLayout
from vllm_backend.side_channel import SideChannelServer, WorkerInfo


class NativeKVSource:
    """Side channel of a single-rank native engine whose cache ``layout`` is registered with Mooncake."""

    def __init__(self, layout: CacheLayout, block_size: int, release: Callable[[str], Any],
                 host: str = "127.0.0.1", port: int = 0, engine_id: str | None = None) -> None:
        self.engine_id = engine_id or f"native-{uuid.uuid4().hex[:8]}"
        self._release = release
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._done: dict[str, set[str]] = {}
        self._server = SideChannelServer(host, port, self._serve)
        vllm_layout = dict(tp=1, pcp=1, dcp=1, pp=1, interleave=1, block_size=block_size)
        regions = {str(i): [r.base, r.num_blocks, r.block_bytes] for i, r in layout.regions.items()}
        self._info = WorkerInfo(0, 0, layout.endpoint, self._server.address, vllm_layout, regions)

    def publish(self, request_id: str, block_ids: list[int], num_tokens: int) -> dict[str, Any]:
        """The decode request's ``kv_transfer_params`` for a held request (blocks from position 0)."""
        with self._lock:
            self._held.add(request_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": list(block_ids),
            "remote_host": self._server.host,
            "remote_port": self._server.port,
            "remote_num_tokens": num_tokens,
            "transfer_id": f"{self.engine_id}/{request_id}",
        }

    def _serve(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") == "layout":
            return {"engine_id": self.engine_id, "workers": [asdict(self._info)]}
        if req.get("op") == "done":
            rid = req["req"]
            with self._lock:
                if rid not in self._held:
                    return {"ok": False}
                seen = self._done.setdefault(rid, set())
                seen.add(req["from"])
                finished = len(seen) >= int(req["of"])
                if finished:
                    self._held.discard(rid)
                    del self._done[rid]
            if finished:
                self._release(rid)
            return {"ok": True}
        raise ValueError(f"unknown op {req.get('op')!r}")

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        self._server.close()
