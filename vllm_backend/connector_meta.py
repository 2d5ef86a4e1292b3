"""What ``PdKVConnector``'s two halves share: its settings and the messages that pass between them.

The scheduler half (``connector_scheduler``) and the worker half (``connector_worker``) run in
different processes; vLLM carries these between them: ``WorkerTable`` from every worker to the
scheduler (``get_handshake_metadata`` -> ``set_xfer_handshake_metadata_pp_aware``), and
``PdConnectorMetadata`` (with its ``RecvJob``s) from the scheduler to every worker, once per step
(``build_connector_meta`` -> ``start_load_kv``). Both are pickled, so they hold plain data only.
Also here: which ``kv_transfer_params`` name a producer to pull from (the scheduler decides; the
worker reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from vllm_backend import handle_params
from vllm_backend.side_channel import WorkerInfo

# The keys of vLLM's NIXL convention that locate a vLLM producer and the request's blocks there.
REQUIRED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")


def loadable(params: dict[str, Any]) -> bool:
    """Params naming a producer to pull from: its side channel, or a native node's KV handle."""
    return all(k in params for k in REQUIRED) or handle_params.has_handle(params)


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


@dataclass(frozen=True)
class EngineIdentity:
    """Who this connector is, for both halves: from ``VllmConfig``, the same in every process."""

    engine_id: str
    dp: int  # data_parallel_rank: each DP engine has its own connector and side-channel port
    is_producer: bool
    is_consumer: bool
    # tp, pcp, dcp, pp, interleave: this engine's VllmKVLayout without its block size
    parallel: dict[str, int]


@dataclass
class WorkerTable(KVConnectorHandshakeMetadata):
    """Every worker's ``WorkerInfo`` (all-gathered, so one worker's table is the engine's)."""

    workers: list[WorkerInfo]


@dataclass
class RecvJob:
    """One request's load, decided by the consumer's scheduler and run by each of its workers."""

    request_id: str  # local
    params: dict[str, Any]
    block_ids: list[int]  # the request's local block table (from position 0)
    start: int  # first position to load (after the local prefix hit)
    end: int  # positions [start, end) are loaded; start == end: only tell the producer


@dataclass
class PdConnectorMetadata(KVConnectorMetadata):
    """One step's news for the workers."""

    recv: list[RecvJob] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # requests whose blocks now await a reader
